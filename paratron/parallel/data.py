"""Data parallelism: gradients accumulate into one contiguous fp32 buffer, reduced over the
data(-and-context)-parallel group once per step; and the cross-group gradient fix-ups that every
layout needs before the optimizer step (Megatron's ``finalize_model_grads``).

Each parameter gets ``param.main_grad``, an fp32 view into the buffer. A hook run after autograd
accumulates a parameter's gradient adds it to ``main_grad`` and frees ``param.grad``, so bf16
parameters accumulate micro-batch gradients in fp32 and nothing is communicated until
``finish_grad_sync()`` after the last micro-batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .dims import ParallelDims


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, dims: ParallelDims, grad_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.module, self.dims = module, dims
        self.params = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        offset = 0
        self._hooks = []
        for p in self.params:
            p.main_grad = self.grad_buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    @staticmethod
    def _accumulate(p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()

    def finish_grad_sync(self) -> None:
        """Average the gradient buffer over the data-parallel (x context-parallel) ranks."""
        group = self.dims.dp_cp_group
        n = comm.group_size(group)
        if n > 1:
            self.grad_buffer.div_(n)
            dist.all_reduce(self.grad_buffer, group=group)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)


def finalize_model_grads(models: list[DataParallel], dims: ParallelDims) -> None:
    """After the last backward of a step: data-parallel reduction, then the sums over TP of the
    gradients of sequence-parallel replicated parameters, then the sum over the embedding group of
    the tied embedding's two copies (first and last pipeline stage)."""
    for m in models:
        m.finish_grad_sync()
    if dims.tp > 1:
        sp = [p.main_grad for m in models for p in m.params if getattr(p, "sequence_parallel", False)]
        if sp:
            flat = torch.cat([g.reshape(-1) for g in sp])
            dist.all_reduce(flat, group=dims.tp_group)
            offset = 0
            for g in sp:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
    if dims.pp > 1 and dims.embedding_group is not None:
        for m in models:
            for p in m.params:
                if getattr(p, "shared_embedding", False) or getattr(p, "is_word_embedding", False):
                    dist.all_reduce(p.main_grad, group=dims.embedding_group)

"""The distributed optimizer (ZeRO-1, Megatron's ``--use-distributed-optimizer``).

Each data-parallel (x context-parallel) rank owns one equal shard of every gradient bucket (see
paratron/parallel/data.py). After the reduce-scatter, the rank holds the summed gradient of its
shard only; it keeps fp32 masters and Adam moments for that shard only, steps them, writes the
result into its shard of the contiguous parameter buffer, and the buckets are all-gathered so that
every rank has the full updated parameters again.

A shard cuts through parameters: this rank's part of a parameter is a *piece*, a contiguous range
of its flattened elements. Masters, gradients and Adam states are 1-D tensors, one per piece. For
fp32 parameters the master of a piece is a view of the parameter buffer itself (no copy), as in
Megatron; for bf16/fp16 parameters it is an fp32 copy.

The gradient norm is the square root of the sum over this rank's pieces (TP-replicated parameters
counted on TP rank 0 only, the pipeline copy of a tied embedding not at all), summed over the
dp x cp group and then over the model-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Config
from ..parallel.data import DataParallel
from ..parallel.dims import ParallelDims
from .optimizer import MixedPrecisionAdam, counts_for_norm


@dataclass
class Piece:
    model: int  # index of the model chunk
    param: torch.nn.Parameter
    lo: int  # this rank's range in the chunk's buffers
    hi: int


def shard_pieces(models: list[DataParallel]) -> list[Piece]:
    """This rank's pieces of every parameter, in buffer order."""
    pieces = []
    for i, m in enumerate(models):
        for b in m.buckets:
            lo, hi = m.shard_range(b)
            for p in b.params:
                start = m.param_offsets[p]
                a, z = max(lo, start), min(hi, start + p.numel())
                if a < z:
                    pieces.append(Piece(i, p, a, z))
    return pieces


class DistributedOptimizer(MixedPrecisionAdam):
    def __init__(self, models: list[DataParallel], cfg: Config, dims: ParallelDims):
        for m in models:
            if m.param_buffer is None and m.params:
                raise ValueError("the distributed optimizer needs the model wrapped with use_distributed_optimizer=True")
        self.models, self.dims = models, dims
        self.pieces = shard_pieces(models)
        self.mixed = any(pc.param.dtype != torch.float32 for pc in self.pieces)
        with torch.no_grad():
            self._param_views = [models[pc.model].param_buffer[pc.lo: pc.hi] for pc in self.pieces]
            self._grad_views = [models[pc.model].grad_buffer[pc.lo: pc.hi] for pc in self.pieces]
            masters = [v.detach().float().clone() if v.dtype != torch.float32 else v.detach()
                       for v in self._param_views]
        self._setup(masters, [pc.param.dim() > 1 for pc in self.pieces],
                    [counts_for_norm(pc.param, dims) for pc in self.pieces], cfg, dims)

    def _grads(self) -> list[torch.Tensor]:
        return [g if g.dtype == torch.float32 else g.float() for g in self._grad_views]

    def _norm_groups(self) -> list:
        return [self.dims.dp_cp_group, self.dims.mp_group]

    def _publish(self) -> None:
        if self.mixed:
            torch._foreach_copy_(self._param_views, self.masters)
        for m in self.models:
            m.start_param_sync()

    def _own_masters(self) -> list[torch.Tensor]:
        return self.masters if self.mixed else []

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy this rank's shard of the model's parameters into the masters (after loading weights)."""
        for m in self.models:
            m.finish_param_sync()
        if self.mixed:
            torch._foreach_copy_(self.masters, self._param_views)

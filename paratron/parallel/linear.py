"""The linear layers' dispatch: ``x W^T (+ b) (+ residual)`` and the embedding lookup, with Megatron's
gradient-accumulation fusion (on unless ``--no-gradient-accumulation-fusion``): the backward adds the weight's
gradient straight into the fp32 ``main_grad`` buffer of paratron/parallel/data.py (kernels in
paratron/kernels/accumulate.py), so the bf16 gradient is never written, read back and added.

Which weights take it: those a layer marked ``wgrad_fusable`` in their ShardSpec (every training use of the
weight goes through ``linear`` below or the gated MLP's own backward, which both honour the mark) whose layer
has no FP8 state, or the blockwise recipe's (its linear and fused MLP take ``main_grad_of``: paratron/fp8/
blockwise.py); ``DataParallel`` then sets the spec's ``fuse_wgrad`` and skips them in its hook. Autograd still
gets a gradient for each of them (an uninitialised placeholder: its allocation is all it costs), so the hooks
that count a bucket's gradients (--overlap-grad-reduce) run as before.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .sharding import REPLICATED, spec_of, update_spec
from ..fp8.linear import fuses_wgrad
from ..kernels import cublaslt
from ..kernels.accumulate import embedding_accumulate, residual_addmm, wgrad_accumulate


class _FusedLinear(torch.autograd.Function):
    """``x W^T (+ b) (+ residual)`` whose backward adds W's gradient to ``main_grad`` itself."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, main_grad, lt):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad  # (not saved: its version changes as it accumulates, by design)
        ctx.has_bias, ctx.has_residual, ctx.lt = bias is not None, residual is not None, lt
        return _plain(x, weight, bias, residual, lt, training=True)  # (autograd is off inside forward)

    @staticmethod
    def backward(ctx, dy):
        (x, weight), main_grad = ctx.saved_tensors, ctx.main_grad
        dy2 = dy.reshape(-1, dy.size(-1))
        wgrad_accumulate(main_grad, dy2, x.reshape(-1, x.size(-1)), False)
        dbias = dy2.sum(0).to(weight.dtype) if ctx.has_bias else None
        dx = cublaslt.mm(dy2, weight.t(), ctx.lt).view(*dy.shape[:-1], weight.size(1))  # cuBLAS or cuBLASLt
        return (dx, torch.empty_like(weight), dbias, dy if ctx.has_residual else None, None, None)


def _plain(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], lt: bool = True,
           training: Optional[bool] = None) -> Tensor:
    """``x W^T + b + residual``: the residual as the matmul's C operand when there is no bias (one row,
    as in batch-1 decoding, stays matmul + add, which a compiled step makes one GEMV kernel). In training
    ``residual_addmm`` (torch's addmm copies C into its output first). ``training``: None, autograd's state
    says."""
    if residual is not None and bias is None and x.numel() != x.size(-1):
        c, a = residual.reshape(-1, weight.size(0)), x.reshape(-1, x.size(-1))
        training = torch.is_grad_enabled() if training is None else training
        if training:  # (not in generation: its prompts' lengths vary, and cuBLASLt's choice is made per shape)
            return residual_addmm(c, a, weight, lt).view(residual.shape)
        return torch.addmm(c, a, weight.t()).view(residual.shape)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None,
           cublaslt: bool = True) -> Tensor:
    """``x W^T (+ b) (+ residual)``; with autograd on and W marked ``fuse_wgrad`` (by DataParallel), W's
    gradient goes straight into ``W.main_grad``. ``cublaslt``: the ``--kernel-cublaslt`` switch."""
    main_grad = main_grad_of(weight)
    if main_grad is not None:
        return _FusedLinear.apply(x, weight, bias, residual, main_grad, cublaslt)
    return _plain(x, weight, bias, residual, cublaslt)


class _FusedEmbedding(torch.autograd.Function):
    """``weight[ids]`` whose backward adds the table's gradient to ``main_grad`` itself."""

    @staticmethod
    def forward(ctx, ids, weight, main_grad):
        ctx.save_for_backward(ids)
        ctx.main_grad, ctx.shape = main_grad, weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        embedding_accumulate(ctx.main_grad, ids.reshape(-1), dy.reshape(-1, dy.size(-1)).contiguous())
        return None, dy.new_empty(ctx.shape), None


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """``F.embedding(ids, weight)``; with autograd on and the table marked ``fuse_wgrad`` (by DataParallel),
    its gradient goes straight into ``weight.main_grad``: no [vocab, h] gradient is zeroed, scattered,
    sorted and added (those passes in llama-1b's step profile:
    benchmarks/results/profile_kernels_llama-1b_mb16x2_7056be8.tsv)."""
    main_grad = main_grad_of(weight)
    if main_grad is not None:
        return _FusedEmbedding.apply(ids, weight, main_grad)
    return F.embedding(ids, weight)


def main_grad_of(weight: Tensor) -> Optional[Tensor]:
    """``weight.main_grad`` when its gradient is to be added there by the backward (``fuse_wgrad``), else
    None; for code with its own weight-gradient GEMMs (the gated MLP)."""
    return weight.main_grad if torch.is_grad_enabled() and fused_wgrad(weight) else None


def fused_wgrad(weight: Tensor) -> bool:
    """Whether DataParallel fuses ``weight``'s gradient accumulation (its ShardSpec's ``fuse_wgrad``)."""
    return getattr(weight, "_shard_spec", REPLICATED).fuse_wgrad


def mark_fusable(*layers) -> None:
    """Say that every training use of these layers' weights (Column/RowParallelLinear, an untied
    VocabParallelEmbedding) goes through ``linear`` / ``embedding`` or honours ``main_grad_of``:
    DataParallel may then fuse their weight gradients."""
    for layer in layers:
        update_spec(layer.weight, wgrad_fusable=True)


def fusable_weights(module: torch.nn.Module) -> list:
    """The weights of ``module`` whose gradient accumulation can be fused: marked ``wgrad_fusable`` by
    their layer, trainable, and the layer without an FP8 state or with one whose backward adds to ``main_grad``
    (``fuses_wgrad``: the blockwise recipe's; the other FP8 matmuls' backward hands autograd the gradient)."""
    return [m.weight for m in module.modules()
            if isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.requires_grad
            and spec_of(m.weight).wgrad_fusable
            and (getattr(m, "fp8", None) is None or fuses_wgrad(m.fp8))]

"""The MLP under ``--fp8-recipe blockwise`` as one autograd function: fc1 -> SwiGLU -> fc2 with the SwiGLU's output
and its input gradient written straight into FP8 tiles in both layouts (kernels/fp8_block_mlp.py), where layer by
layer (paratron/fp8/blockwise.py around the SwiGLU) each is written in bf16 and read again by a tile cast.

The GEMMs are the blockwise linear's (kernels/fp8_block.py, by ``--kernel-fp8-block-gemm``): the forward and the
input gradients from tiles along the summed dimension and the weights' 128 x 128 blocks, the weight gradients from
tiles along the tokens. Saved for the backward: x^T's tiles, the weights' blocks, fc1's output (bf16, for the
SwiGLU's gradient) and the SwiGLU's output transposed in tiles (fc2's weight gradient). Numerics: the recipe's,
with the SwiGLU's output and gradient quantised from fp32 rather than from their bf16 rounding (as in the
tensorwise fused MLP, paratron/fp8/mlp.py). SwiGLU without fc1 bias only; other activations keep the per-layer
path (``applies``).

With Megatron's gradient-accumulation fusion (``main_grads``: the weights' float32 gradient buffers, given where
DataParallel fuses them) each weight gradient is added to its buffer by its GEMM (``block_mm_accumulate``), fc1's
in its rows' [gate; up] order as the GEMM produces it, and autograd gets an uninitialised placeholder (as from
paratron/fp8/blockwise.py)."""
from __future__ import annotations

import torch

from ..kernels.fp8_block import block_mm, quantize_blocks
from ..kernels.fp8_block_mlp import swiglu_grad_tiles, swiglu_tiles
from ..kernels.fp8_tile_cast import tiles_both
from .blockwise import block_path, tile_wgrad
from .recipe import E4M3, FP8State


def _weight(state: FP8State, w: torch.Tensor, wq, sw):
    if wq is None:  # (else the step's cached blocks, fp8/weights.py)
        state.mark("weight")
        wq, sw = quantize_blocks(w, E4M3, state.recipe.margin)
    return wq, sw


class _BlockMLP(torch.autograd.Function):
    """y = SwiGLU(x W1^T) W2^T with every GEMM in blockwise FP8 (the module docstring)."""

    @staticmethod
    def forward(ctx, x, w1, w2, s1: FP8State, s2: FP8State, w1q, sw1, w2q, sw2, mg1, mg2):
        path, margin, cast = block_path(s1), s1.recipe.margin, s1.recipe.block_cast
        x2 = x.reshape(-1, x.size(-1))
        s1.mark("input")
        xq, sx, xtq, sxt = tiles_both(x2, margin, cast)
        w1q, sw1 = _weight(s1, w1, w1q, sw1)
        h = block_mm(xq, sx, w1q, sw1, True, x.dtype, path)  # [M, 2F]
        s2.mark("input")
        aq, sa, atq, sat = swiglu_tiles(h, margin)
        w2q, sw2 = _weight(s2, w2, w2q, sw2)
        y = block_mm(aq, sa, w2q, sw2, True, x.dtype, path)
        ctx.save_for_backward(xtq, sxt, w1q, sw1, h, atq, sat, w2q, sw2)
        ctx.s1, ctx.s2, ctx.path, ctx.x_shape, ctx.w_dtype = s1, s2, path, x.shape, w1.dtype
        ctx.main_grads = (mg1, mg2)  # (not saved: their versions change as they accumulate, by design)
        return y.view(*x.shape[:-1], w2.size(0))

    @staticmethod
    def backward(ctx, g):
        xtq, sxt, w1q, sw1, h, atq, sat, w2q, sw2 = ctx.saved_tensors
        s1, s2, path = ctx.s1, ctx.s2, ctx.path
        margin, cast = s1.recipe.margin, s1.recipe.block_cast
        s2.mark("grad")
        gq, sg, gtq, sgt = tiles_both(g.reshape(-1, g.size(-1)), margin, cast)
        dact = block_mm(gq, sg, w2q.t(), sw2.t(), True, g.dtype, path)  # [M, F]
        mg1, mg2 = (mg if needs else None for mg, needs in zip(ctx.main_grads, ctx.needs_input_grad[1:3]))
        gw2 = tile_wgrad(gtq, sgt, atq, sat, mg2, ctx.w_dtype, path)
        s1.mark("grad")
        dq, sd, dtq, sdt = swiglu_grad_tiles(h, dact, margin)
        gx = block_mm(dq, sd, w1q.t(), sw1.t(), True, g.dtype, path).view(ctx.x_shape)
        gw1 = tile_wgrad(dtq, sdt, xtq, sxt, mg1, ctx.w_dtype, path)  # rows [gate; up], as w1's
        return gx, gw1, gw2, *(None,) * 8


def applies(s1, s2, swiglu: bool, bias: bool) -> bool:
    """Whether fc1 -> SwiGLU -> fc2 can run as :func:`block_mlp` (blockwise on both with FP8 weight gradients)."""
    return (swiglu and not bias and s1 is not None and s2 is not None and s1.recipe == s2.recipe
            and s1.recipe.recipe == "blockwise" and s1.recipe.fuse_mlp and s1.recipe.fp8_wgrad)


def block_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, s1: FP8State, s2: FP8State,
              main_grads: tuple = (None, None)) -> torch.Tensor:
    """``F.linear(SwiGLU(F.linear(x, w1)), w2)`` in blockwise FP8 (the local matmuls of a TP-split MLP).
    ``main_grads``: (fc1's, fc2's) float32 gradient buffers the weight gradients are added to, each None for
    autograd's gradient."""
    (w1q, sw1, _), (w2q, sw2, _) = s1.cached_weight(), s2.cached_weight()
    return _BlockMLP.apply(x, w1, w2, s1, s2, w1q, sw1, w2q, sw2, *main_grads)

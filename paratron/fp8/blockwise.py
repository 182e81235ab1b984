"""The FP8 linear of ``--fp8-recipe blockwise`` (DeepSeek-V3's scaling): activations and gradients with a scale
per 1 x 128 tile along the dimension each GEMM sums over, weights with a scale per 128 x 128 block, all e4m3.

Forward ``y = x W^T``: x in tiles along K (its rows), W in blocks. Backward: the input gradient ``g W`` from
g in tiles along N and the forward's FP8 weight (a 128 x 128 block is one block either way round, so its
scales are transposed, not recomputed); the weight gradient ``g^T x`` sums over the tokens, so it takes g^T
and x^T in tiles along the tokens (x^T quantised in the forward and kept instead of x; with
``--no-fp8-wgrad`` x itself is kept and the weight gradient is g^T x in the input's dtype). The scales and
GEMMs are paratron/kernels/fp8_block.py.

With Megatron's gradient-accumulation fusion (``main_grad``: the weight's float32 gradient buffer, given by the
parallel layers where DataParallel fuses the weight) the weight gradient is added to that buffer by its GEMM
(``block_mm_accumulate``; with ``--no-fp8-wgrad`` g^T x in float32, kernels/accumulate.py) and never written in
the weight's dtype; autograd gets an uninitialised placeholder, as from paratron/parallel/linear.py's fused linear,
so the hooks that count a bucket's gradients still run."""
from __future__ import annotations

import torch

from ..kernels.accumulate import wgrad_accumulate
from ..kernels.fp8_block import block_mm, block_mm_accumulate, quantize_blocks, quantize_tiles
from ..kernels.fp8_tile_cast import tiles_both
from .recipe import E4M3, FP8State


def block_path(state: FP8State) -> str:
    """The GEMM path of the blockwise recipe (kernels/fp8_block.py's BLOCK_GEMMS)."""
    return "emulate" if state.recipe.emulate else state.recipe.block_gemm


class _BlockLinear(torch.autograd.Function):
    """y = x W^T with blockwise-scaled e4m3 operands (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, state, wq, sw, main_grad):
        margin, path = state.recipe.margin, block_path(state)
        x2 = x.reshape(-1, x.size(-1))
        state.mark("input")
        if state.recipe.fp8_wgrad:  # x in tiles along K and, transposed, along the tokens (the weight gradient's)
            xq, sx, xtq, sxt = tiles_both(x2, margin, state.recipe.block_cast)
        else:
            xq, sx = quantize_tiles(x2, E4M3, margin)
        if wq is None:  # (else the step's cached blocks, fp8/weights.py)
            state.mark("weight")
            wq, sw = quantize_blocks(weight, E4M3, margin)
        y = block_mm(xq, sx, wq, sw, True, x.dtype, path)
        if state.recipe.fp8_wgrad:
            ctx.save_for_backward(xtq, sxt, wq, sw)
        else:
            ctx.save_for_backward(x2, None, wq, sw)
        ctx.state, ctx.x_shape, ctx.w_dtype, ctx.path = state, x.shape, weight.dtype, path
        ctx.main_grad = main_grad  # (not saved: its version changes as it accumulates, by design)
        return y.view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, g):
        x_saved, sxt, wq, sw = ctx.saved_tensors
        state, path, margin = ctx.state, ctx.path, ctx.state.recipe.margin
        g2 = g.reshape(-1, g.size(-1))
        state.mark("grad")
        gx = gw = None
        dgrad, wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and sxt is not None
        if dgrad and wgrad:  # g in tiles along N and, transposed, along the tokens
            gq, sg, gtq, sgt = tiles_both(g2, margin, state.recipe.block_cast)
        elif dgrad:
            gq, sg = quantize_tiles(g2, E4M3, margin)
        elif wgrad:
            gtq, sgt = quantize_tiles(g2.t(), E4M3, margin)
        if dgrad:  # [M, N] (tiles along N) times W [N, K] (blocks, transposed)
            gx = block_mm(gq, sg, wq.t(), sw.t(), True, g.dtype, path).view(ctx.x_shape)
        main_grad = ctx.main_grad if ctx.needs_input_grad[1] else None
        if wgrad:  # g^T [N, M] times x [M, K], both in tiles along M
            gw = tile_wgrad(gtq, sgt, x_saved, sxt, main_grad, ctx.w_dtype, path)
        elif main_grad is not None:  # --no-fp8-wgrad: g^T x in float32, into main_grad
            wgrad_accumulate(main_grad, g2, x_saved, False)
            gw = g2.new_empty(main_grad.shape, dtype=ctx.w_dtype)
        elif ctx.needs_input_grad[1]:
            gw = (g2.t() @ x_saved).to(ctx.w_dtype)
        return gx, gw, None, None, None, None


def tile_wgrad(gq, sg, xq, sx, main_grad, w_dtype, path: str) -> torch.Tensor:
    """The weight gradient g^T x from both in tiles along the tokens: returned in ``w_dtype``, or, given
    ``main_grad``, added to it by the GEMM and an uninitialised placeholder returned for autograd (the module
    docstring)."""
    if main_grad is None:
        return block_mm(gq, sg, xq, sx, False, w_dtype, path)
    block_mm_accumulate(main_grad, gq, sg, xq, sx, path, w_dtype)
    return gq.new_empty(main_grad.shape, dtype=w_dtype)


def block_linear(x: torch.Tensor, weight: torch.Tensor, state: FP8State, wq=None, sw=None,
                 main_grad=None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) in blockwise-scaled FP8; output in x's dtype. ``wq``, ``sw``: the weight's
    blocks where the step's weight cache holds them; ``main_grad``: the float32 buffer the weight gradient is added
    to (the module docstring), or None for autograd's gradient."""
    return _BlockLinear.apply(x, weight, state, wq, sw, main_grad)

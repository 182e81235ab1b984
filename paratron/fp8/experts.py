"""FP8 for the routed experts: their grouped GEMMs (forward, input gradient, weight gradient) with the run's
recipe. Tensorwise and delayed: one scale for the rows of all local experts, one for all their weights and
one for the output gradient (the layer's FP8State, as a dense linear's); blockwise: 1 x 128 tiles of the rows
and gradients along the summed dimension, a 128 x 128 block scale per expert weight block.

The rows come sorted by expert and padded so that each expert's rows start at a multiple of the GEMM's
alignment (``kernels.fp8_grouped.align_for``: 16, or 128 so that a blockwise tile along the tokens never holds
two experts' rows; the padding rows are zero and come back as zero). The GEMMs are
paratron/kernels/fp8_grouped.py; no path reads the group sizes on the host."""
from __future__ import annotations

import torch

from ..kernels.fp8_block import quantize_tiles, quantize_blocks
from ..kernels.fp8_grouped import align_for, as_dtype, grouped_forward, grouped_wgrad
from ..kernels.fp8_tile_cast import tiles_both
from .recipe import E4M3, FAST_ACCUM_FORWARD, FP8State


def scale_kind(state: FP8State) -> str:
    return "block" if state.recipe.recipe == "blockwise" else "tensor"


def alignment(state: FP8State) -> int:
    """Each expert's rows start at a multiple of this under ``state``'s recipe (and DeepGEMM's tensorwise forward,
    whose groups start at whole 128-row tiles)."""
    return align_for("block" if grouped_path(state, "tensor") == "deepgemm" else scale_kind(state))


def grouped_path(state: FP8State, kind: str) -> str:
    """emulate (tests), the switch's torch._scaled_grouped_mm (tensor scales only) or Triton / DeepGEMM kernel
    (block scales: kernels/fp8_block_grouped.py, kernels/experimental/deepgemm.py), else dequant."""
    if state.recipe.emulate:
        return "emulate"
    if kind == "block" and state.recipe.block_grouped_gemm in ("triton", "deepgemm"):
        return state.recipe.block_grouped_gemm
    if kind == "tensor" and state.recipe.grouped_gemm in ("scaled_grouped_mm", "deepgemm"):
        return state.recipe.grouped_gemm
    return "dequant"


def wgrad_path(state: FP8State, kind: str, path: str) -> str:
    """The weight gradient's path beside the forward's ``path``: under block scales the Triton weight-gradient kernel
    where ``--kernel-fp8-block-grouped-wgrad triton`` asks (kernels/fp8_block_grouped.py); the forward's Triton
    kernel has no weight gradient, so its ``triton`` becomes ``dequant``; the rest as kernels/fp8_grouped.py's
    :func:`grouped_wgrad` maps them (``deepgemm``)."""
    if kind == "block" and not state.recipe.emulate and state.recipe.block_grouped_wgrad == "triton":
        return "triton"
    return "dequant" if path == "triton" else path


def weight_blocks(w: torch.Tensor, margin: int):
    """Each expert's weight [E, N, K] in 128 x 128 blocks (N a multiple of 128: the config checks it)."""
    e, n, k = w.shape
    if n % 128:
        raise ValueError(f"blockwise FP8 experts need weight rows in multiples of 128 (got {n})")
    q, s = quantize_blocks(w.reshape(e * n, k), E4M3, margin)
    return q.view(e, n, k), s


def transposed_blocks(wq: torch.Tensor, sw: torch.Tensor):
    """[E, N, K] in blocks -> [E, K, N] in blocks (the same blocks, their scales transposed per expert)."""
    e, n, k = wq.shape
    s = sw.view(e, n // 128, -1).transpose(1, 2).reshape(-1, n // 128)
    return wq.transpose(1, 2).contiguous(), s.contiguous()


def quantize_rows(x: torch.Tensor, state: FP8State, kind: str):
    """(xq, sx, xq^T, sx^T): the rows for the forward and, transposed, for the weight gradient (None, None
    with --no-fp8-wgrad, which keeps the bf16 rows instead). Tensorwise / delayed: both from one read of x
    (the scaler's ``quantize_both``, as the dense layers' gradients)."""
    wgrad = state.recipe.fp8_wgrad
    if kind == "block":
        if wgrad:
            return tiles_both(x, state.recipe.margin, state.recipe.block_cast)
        return (*quantize_tiles(x, E4M3, state.recipe.margin), None, None)
    if not wgrad:
        return (*state.quantize("input", x), None, None)
    state.mark("input")
    xq, xtq, sx = state.input.quantize_both(x)
    return xq, sx, xtq, sx


class _FP8GroupedMM(torch.autograd.Function):
    """Rows ``x`` [S, K] of expert e times ``w[e]``^T ([E, N, K]); ``ends``: each expert's end row (int32)."""

    @staticmethod
    def forward(ctx, x, w, ends, state):
        kind = scale_kind(state)
        path = grouped_path(state, kind)
        if kind == "block":
            state.mark("input")
            state.mark("weight")
        bf16_backward = backward_path(state, path) == "bf16"
        if bf16_backward:  # only the forward's FP8 copies are made: the backward reads x and w themselves
            xq, sx = state.quantize("input", x)
        else:
            xq, sx, xtq, sxt = quantize_rows(x, state, kind)
        wq, sw = weight_blocks(w, state.recipe.margin) if kind == "block" else state.quantize("weight", w)
        y = grouped_forward(xq, sx, wq, sw, ends, kind, x.dtype, path, fast_accum=FAST_ACCUM_FORWARD)
        if bf16_backward:
            ctx.save_for_backward(x, w, ends)
        else:
            keep = (xtq, sxt) if state.recipe.fp8_wgrad else (x, None)
            ctx.save_for_backward(*keep, wq, sw, ends)
        ctx.state, ctx.kind, ctx.path, ctx.w_dtype = state, kind, path, w.dtype
        ctx.bf16_backward = bf16_backward
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if ctx.bf16_backward:
            x, w, ends = ctx.saved_tensors
            return (*bf16_grads(g, x, w, ends, ctx.needs_input_grad[:2], ctx.w_dtype), None, None)
        x_saved, sxt, wq, sw, ends = ctx.saved_tensors
        state, kind, path = ctx.state, ctx.kind, ctx.path
        if kind == "block":
            state.mark("grad")
            gq, sg, gtq, sgt = tiles_both(g, state.recipe.margin, state.recipe.block_cast)
            wt, swt = transposed_blocks(wq, sw)
        elif sxt is None:  # --no-fp8-wgrad: the weight gradient reads g itself, so no transposed copy of it
            gq, sg = state.quantize("grad", g)
            gtq, sgt, wt, swt = None, None, wq.transpose(1, 2).contiguous(), sw
        else:
            gq, gtq, sg = state.quantize_grad(g)
            sgt, wt, swt = sg, wq.transpose(1, 2).contiguous(), sw
        gx = grouped_forward(gq, sg, wt, swt, ends, kind, g.dtype, path) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1] and sxt is not None:
            gw = grouped_wgrad(gtq, sgt, x_saved, sxt, ends, kind, ctx.w_dtype, wgrad_path(state, kind, path))
        elif ctx.needs_input_grad[1]:  # --no-fp8-wgrad: from the bf16 rows and output gradient
            gw = as_dtype(torch._grouped_mm(g.t(), x_saved, offs=ends), ctx.w_dtype)
        return gx, gw, None, None


def backward_path(state: FP8State, path: str) -> str:
    """The backward's GEMM path: the forward's, except that torch's and DeepGEMM's grouped FP8 GEMMs take e4m3
    operands only, so hybrid's e5m2 output gradients take "bf16" there (:func:`bf16_grads`)."""
    return "bf16" if path in ("scaled_grouped_mm", "deepgemm") and state.grad.dtype != E4M3 else path


def bf16_grads(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, needs: tuple,
               w_dtype: torch.dtype) -> tuple:
    """(input gradient, weight gradient) of hybrid's experts where the grouped GEMM cannot take e5m2: the output
    gradient, the rows ``x`` and the weight ``w`` as they are (the forward's FP8 operands are not kept), in
    torch's grouped GEMM. Casting the gradient to e5m2 and back, as an FP8 GEMM would read it, only cost two passes
    over it and lost precision (measured: benchmarks/results/moe_peers_h200_20261202.md, FP8 hybrid below bf16);
    dequantising the forward's FP8 weight and rows for these GEMMs cost passes over both and kept an FP8 transposed
    copy of the rows, where the rows themselves hold more."""
    gx = gw = None
    if needs[0]:
        gx = torch._grouped_mm(g, as_dtype(w, g.dtype), offs=ends)
    if needs[1]:
        gw = as_dtype(torch._grouped_mm(g.t(), as_dtype(x, g.dtype), offs=ends), w_dtype)
    return gx, gw


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, state: FP8State) -> torch.Tensor:
    """The experts' ``x_e w_e^T`` in FP8 per ``state``'s recipe; rows padded as the module docstring says."""
    return _FP8GroupedMM.apply(x, w, ends, state)

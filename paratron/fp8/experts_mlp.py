"""The routed experts' MLP in FP8 as one autograd function: fc1's grouped GEMM, the activation written straight
into FP8, fc2's grouped GEMM, and in the backward the activation's gradient written straight into FP8 (the
dense layers' fused FP8 MLP, paratron/fp8/mlp.py, over rows sorted by expert).

Layer by layer (paratron/fp8/experts.py) the tensors between the GEMMs make extra trips through memory: the
activation writes its output in bf16 and fc2 reads it again for the amax and once more to cast it; in the
backward the activation's gradient (the widest tensor of the layer, [rows, 2 x FFN] with SwiGLU) is written in
bf16 and read twice more for fc1's cast. Here both are computed from fc1's output and written once, in FP8,
row-major for the next GEMM and transposed for the weight gradient (``paratron::mlp_act_fp8`` and
``paratron::mlp_act_fp8_backward``); the rows and the output gradient are cast in both layouts in one op
(``paratron::cast_fp8``). With the tensorwise recipe each cast takes a pass for the amax and one to cast; with
the delayed recipe, once primed, the scale is known beforehand and the cast is a single pass.

Under ``--fp8-recipe blockwise`` (:class:`_BlockExpertsMLP`, the dense blockwise fused MLP of
paratron/fp8/block_mlp.py over rows sorted by expert): the rows and the output gradient are cast once into 1 x 128
tiles in both layouts (``tiles_both``), the SwiGLU's output and its input gradient are written straight into tiles
in both layouts by kernels/fp8_block_mlp.py, and the grouped GEMMs, their paths (``--kernel-fp8-block-grouped-gemm``)
and the weight gradients are the per-layer blockwise experts' (fp8/experts.py). Each expert's rows start at a
multiple of 128, so no tile along the rows holds two experts' rows.

Applies (:func:`applies`) where every expert GEMM can run in FP8 with FP8 weight gradients, the same recipe on fc1
and fc2, an activation the kernels have (SwiGLU, GeLU; blockwise: SwiGLU only), no expert biases, and the e4m3
format on torch's grouped FP8 GEMM (it takes no e5m2 gradient: hybrid keeps the per-layer path and its bf16
backward) and under blockwise (e4m3 only). ``--kernel-fp8-fused-mlp off`` keeps the per-layer path, as for the
dense MLP. Numerics are the recipe's; as in the dense fused MLPs the activation's output and gradient are quantised
from fp32 rather than from their bf16 rounding."""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.fp8_block_mlp import swiglu_grad_tiles, swiglu_tiles
from ..kernels.fp8_cast import SWIGLU
from ..kernels.fp8_grouped import grouped_forward, grouped_wgrad
from ..kernels.fp8_tile_cast import tiles_both
from .experts import backward_path, grouped_path, quantize_rows, transposed_blocks, weight_blocks, wgrad_path
from .recipe import E4M3, FAST_ACCUM_FORWARD, FP8State


def why_not(s1: Optional[FP8State], s2: Optional[FP8State], act: Optional[int], biases: bool) -> Optional[str]:
    """Why the fused FP8 experts MLP cannot run fc1 -> ``act`` -> fc2 with the FP8 states ``s1``, ``s2`` (for the
    start-up line), None where it can."""
    if s1 is None or s2 is None or s1.recipe != s2.recipe:
        return "fc1 and fc2 in different precisions or recipes"
    recipe = s1.recipe
    block = recipe.recipe == "blockwise"
    checks = ((recipe.fuse_mlp, "--kernel-fp8-fused-mlp off"), (recipe.fp8_wgrad, "--no-fp8-wgrad"),
              (act is not None, "an activation without a fused FP8 kernel"),
              (not block or act == SWIGLU, "the blockwise recipe with an activation other than SwiGLU"),
              (not biases, "expert biases"),
              (not block or recipe.format == "e4m3", "hybrid: the blockwise recipe takes e4m3 only"),
              (block or backward_path(s1, grouped_path(s1, "tensor")) != "bf16",
               "hybrid: torch's grouped FP8 GEMM takes no e5m2 gradient"))
    return next((why for ok, why in checks if not ok), None)


def applies(s1: Optional[FP8State], s2: Optional[FP8State], act: Optional[int], biases: bool) -> bool:
    """Whether the fused FP8 experts MLP can run fc1 -> ``act`` -> fc2 with the FP8 states ``s1``, ``s2``."""
    return why_not(s1, s2, act, biases) is None


class _FP8ExpertsMLP(torch.autograd.Function):
    """``act(x w1_e^T) w2_e^T`` for the rows ``x`` [S, hidden] of each expert e (``ends``: each expert's end row,
    int32; every row belongs to a group, padding rows being zero)."""

    @staticmethod
    def forward(ctx, x, w1, w2, ends, s1: FP8State, s2: FP8State, act: int):
        path = grouped_path(s1, "tensor")
        s1.mark("input")
        xq, xqt, sx = s1.input.quantize_both(x.contiguous())
        w1q, sw1 = s1.quantize("weight", w1)
        h = grouped_forward(xq, sx, w1q, sw1, ends, "tensor", x.dtype, path, fast_accum=FAST_ACCUM_FORWARD)
        s2.mark("input")
        aq, aqt, sa, current = torch.ops.paratron.mlp_act_fp8(h, None, s2.input.preset_scale(h.device), act,
                                                              s2.recipe.margin, s2.input.known)
        s2.input.record(current)
        w2q, sw2 = s2.quantize("weight", w2)
        y = grouped_forward(aq, sa, w2q, sw2, ends, "tensor", x.dtype, path, fast_accum=FAST_ACCUM_FORWARD)
        ctx.save_for_backward(xqt, sx, w1q, sw1, h, aqt, sa, w2q, sw2, ends)
        ctx.s1, ctx.s2, ctx.act, ctx.path, ctx.w_dtype = s1, s2, act, path, w1.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        xqt, sx, w1q, sw1, h, aqt, sa, w2q, sw2, ends = ctx.saved_tensors
        s1, s2, path, w_dtype = ctx.s1, ctx.s2, ctx.path, ctx.w_dtype
        gq, gqt, sg = s2.quantize_grad(g.contiguous())
        dact = grouped_forward(gq, sg, w2q.transpose(1, 2).contiguous(), sw2, ends, "tensor", g.dtype, path)
        gw2 = grouped_wgrad(gqt, sg, aqt, sa, ends, "tensor", w_dtype, path)
        s1.mark("grad")
        grad = s1.grad
        dhq, dhqt, sdh, current, _ = torch.ops.paratron.mlp_act_fp8_backward(
            h, None, dact, grad.preset_scale(h.device), ctx.act, grad.dtype != E4M3, s1.recipe.margin, grad.known)
        grad.record(current)
        gx = grouped_forward(dhq, sdh, w1q.transpose(1, 2).contiguous(), sw1, ends, "tensor", g.dtype, path)
        gw1 = grouped_wgrad(dhqt, sdh, xqt, sx, ends, "tensor", w_dtype, path)
        return gx, gw1, gw2, None, None, None, None


class _BlockExpertsMLP(torch.autograd.Function):
    """``SwiGLU(x w1_e^T) w2_e^T`` for the rows ``x`` [S, hidden] of each expert e in blockwise FP8 (``ends`` as
    :class:`_FP8ExpertsMLP`'s, each group starting at a multiple of 128). The GEMMs, their operands and the weight
    gradients are fp8/experts.py's blockwise ones; the SwiGLU's output and gradient come as FP8 tiles."""

    @staticmethod
    def forward(ctx, x, w1, w2, ends, s1: FP8State, s2: FP8State):
        path, margin = grouped_path(s1, "block"), s1.recipe.margin
        s1.mark("input")
        s1.mark("weight")
        xq, sx, xtq, sxt = quantize_rows(x.contiguous(), s1, "block")
        w1q, sw1 = weight_blocks(w1, margin)
        h = grouped_forward(xq, sx, w1q, sw1, ends, "block", x.dtype, path, fast_accum=FAST_ACCUM_FORWARD)
        s2.mark("input")
        s2.mark("weight")
        aq, sa, atq, sat = swiglu_tiles(h, margin)
        w2q, sw2 = weight_blocks(w2, margin)
        y = grouped_forward(aq, sa, w2q, sw2, ends, "block", x.dtype, path, fast_accum=FAST_ACCUM_FORWARD)
        ctx.save_for_backward(xtq, sxt, w1q, sw1, h, atq, sat, w2q, sw2, ends)
        ctx.s1, ctx.s2, ctx.path, ctx.w_dtype = s1, s2, path, w1.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        xtq, sxt, w1q, sw1, h, atq, sat, w2q, sw2, ends = ctx.saved_tensors
        s1, s2, path, w_dtype = ctx.s1, ctx.s2, ctx.path, ctx.w_dtype
        margin, wpath = s1.recipe.margin, wgrad_path(s1, "block", path)
        s2.mark("grad")
        gq, sg, gtq, sgt = tiles_both(g.contiguous(), margin, s2.recipe.block_cast)
        dact = grouped_forward(gq, sg, *transposed_blocks(w2q, sw2), ends, "block", g.dtype, path)
        gw2 = grouped_wgrad(gtq, sgt, atq, sat, ends, "block", w_dtype, wpath)
        s1.mark("grad")
        dq, sd, dtq, sdt = swiglu_grad_tiles(h, dact, margin)
        gx = grouped_forward(dq, sd, *transposed_blocks(w1q, sw1), ends, "block", g.dtype, path)
        gw1 = grouped_wgrad(dtq, sdt, xtq, sxt, ends, "block", w_dtype, wpath)
        return gx, gw1, gw2, None, None, None


def fused_experts_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor, s1: FP8State,
                      s2: FP8State, act: int) -> torch.Tensor:
    """The experts' fc1 -> activation -> fc2 on the padded grouped rows ``x`` in FP8 (see the module docstring);
    the last group must end at the last row (rows past it would enter the activation's amax unwritten)."""
    if s1.recipe.recipe == "blockwise":
        return _BlockExpertsMLP.apply(x, w1, w2, ends, s1, s2)
    return _FP8ExpertsMLP.apply(x, w1, w2, ends, s1, s2, act)

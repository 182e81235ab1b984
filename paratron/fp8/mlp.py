"""The MLP in FP8 as one autograd function: fc1 -> activation -> fc2 with the activation's output and
gradient written straight into FP8. Activations: SwiGLU (llama), GeLU exact and tanh-approximate
(GPT, ``--openai-gelu``), with or without fc1's bias (added inside the kernels; its gradient summed
there too); fc2's bias is added by ``RowParallelLinear.exit`` as usual. Described below for SwiGLU.

Run layer by layer (``fp8.fp8_linear`` for fc1 and fc2 around the SwiGLU kernel), the tensor between
the two matmuls makes extra trips through memory: the SwiGLU writes its output in bf16, fc2 reads it
once for the amax and once more to cast it, and the backward transposes the FP8 copy for the weight
gradient; in the backward the SwiGLU writes the [tokens, 2F] gradient in bf16 (the largest tensor of
the block) and fc1 reads it twice (amax, cast) and writes an FP8 copy plus its transpose. Here each
of the two is computed from the SwiGLU's inputs and written once, in FP8, row-major (for the next
matmul) and transposed (for the weight gradient; the stored tile read back after a barrier). With
the tensorwise recipe the cast takes two passes:
the first only finds the amax (one partial maximum per tile, no atomics), the second recomputes the
SwiGLU (or its gradient) and casts. With the delayed recipe, once primed (``fp8.Scaler``), the scale
is known beforehand and the first pass is skipped: the cast pass also leaves the per-tile maxima the
history records. The same kernels with no activation are ``paratron::cast_fp8``, the FP8 linears'
output-gradient cast.

Numerics are those of the recipe (``fp8.py``); the one difference from the layer-by-layer path is that
the activation's output and gradient are quantised from fp32 instead of from their bf16 rounding.
``--glu-linear-offset``, a clamp, quick-GeGLU, squared ReLU, ``--no-bias-swiglu-fusion`` and
``--no-bias-gelu-fusion`` keep the layer-by-layer path (``model.variants.fused_fp8_activation``).

The Triton kernels run on CUDA; elsewhere (the CPU tests) the same two ops are torch expressions.
Triton's CPU interpreter rounds float32 -> float8 differently from the GPU (and from torch), so the
kernels are checked on the GPU (tests/gpu/test_cuda_paths.py) against the torch expressions here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import block_mlp
from .recipe import FAST_ACCUM_FORWARD, FP8State, column_major, forward_mm, input_grad_mm, scaled_mm
from ..kernels.fp8_cast import (E4M3, GELU, GELU_TANH, IDENTITY, SWIGLU, act_fp8_reference, activation,  # noqa: F401
                                activation_grad, cast_fp8, grad_fp8_reference, mlp_act_fp8, mlp_act_fp8_backward)


def applies(fc1, fc2, act: Optional[int]) -> bool:
    """Whether the fused FP8 MLP can replace fc1 -> activation -> fc2 (``act``: one of SWIGLU, GELU,
    GELU_TANH, or None for an activation it does not have)."""
    s1, s2 = fc1.fp8, fc2.fp8  # (--no-fp8-wgrad: the per-layer path, whose weight gradients can be bf16; layers
    # of two recipes, as --te-precision-config-file may give them: each its own)
    if s1 is not None and s1.recipe.recipe == "blockwise":  # SwiGLU without fc1 bias: paratron/fp8/block_mlp.py
        return block_mlp.applies(s1, s2, act == SWIGLU, fc1.bias is not None)
    return (act is not None and s1 is not None and s2 is not None and s1.recipe == s2.recipe and s1.recipe.fuse_mlp
            and s1.recipe.fp8_wgrad and s1.recipe.recipe != "blockwise")


# ---- the two ops, as torch expressions (CPU, and the reference of the kernels) -----------------


class _FP8MLP(torch.autograd.Function):
    """y = act(x W1^T + b1) W2^T with every matmul in FP8 (the two layers' own scalers for x, the
    weights and fc2's output gradient; the activation's output and gradient scaled here)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, s1: FP8State, s2: FP8State, act: int, w1q, sw1, w1t, w2q, sw2, w2t):
        h, xq, sx, w1q, sw1 = forward_mm(x.reshape(-1, x.size(-1)), w1, s1, x.dtype, w1q, sw1)
        s2.mark("input")
        aq, aqt, sa, current = torch.ops.paratron.mlp_act_fp8(h, b1, s2.input.preset_scale(h.device), act,
                                                              s1.recipe.margin, s2.input.known)
        s2.input.record(current)
        if w2q is None:
            w2q, sw2 = s2.quantize("weight", w2)
        y = scaled_mm(aq, w2q.t(), sa, sw2, x.dtype, s2.recipe.emulate, FAST_ACCUM_FORWARD)
        ctx.save_for_backward(xq, w1q, w2q, h, aqt, sx, sw1, sw2, sa, b1, w1t, w2t)
        ctx.s1, ctx.s2, ctx.act, ctx.x_shape, ctx.w_dtype = s1, s2, act, x.shape, w1.dtype
        return y.view(*x.shape[:-1], w2.size(0))

    @staticmethod
    def backward(ctx, g):
        xq, w1q, w2q, h, aqt, sx, sw1, sw2, sa, b1, w1t, w2t = ctx.saved_tensors
        s1, s2 = ctx.s1, ctx.s2
        emulate, margin = s1.recipe.emulate, s1.recipe.margin
        gq, gqt, sg = s2.quantize_grad(g.reshape(-1, g.size(-1)))
        dact = input_grad_mm(gq, sg, w2q, sw2, g.dtype, emulate, w2t)  # [m, F]
        gw2 = scaled_mm(gqt, aqt.t(), sg, sa, ctx.w_dtype, emulate)
        s1.mark("grad")
        dhq, dhqt, sdh, current, db = torch.ops.paratron.mlp_act_fp8_backward(
            h, b1, dact, s1.grad.preset_scale(h.device), ctx.act, s1.grad.dtype != E4M3, margin, s1.grad.known)
        s1.grad.record(current)
        gx = input_grad_mm(dhq, sdh, w1q, sw1, g.dtype, emulate, w1t).view(ctx.x_shape)
        gw1 = scaled_mm(dhqt, column_major(xq), sdh, sx, ctx.w_dtype, emulate)
        return gx, gw1, None if b1 is None else db.to(b1.dtype), gw2, *(None,) * 9


def fused_mlp(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor, s1: FP8State,
              s2: FP8State, act: int = SWIGLU, main_grads: tuple = (None, None)) -> torch.Tensor:
    """``F.linear(act(F.linear(x, w1, b1)), w2)`` in FP8 (the local matmuls of a TP-split MLP). ``main_grads``:
    (fc1's, fc2's) float32 gradient buffers their weight gradients are added to (the blockwise recipe's only:
    fp8/block_mlp.py), each None for autograd's gradient."""
    if s1.recipe.recipe == "blockwise":
        return block_mlp.block_mlp(x, w1, w2, s1, s2, main_grads)
    if any(mg is not None for mg in main_grads):
        raise ValueError(f"the {s1.recipe.recipe} FP8 MLP does not add its weight gradients to main_grad "
                         "(gradient-accumulation fusion is the blockwise recipe's)")
    c1, c2 = s1.cached_weight(), s2.cached_weight()  # the step's cached FP8 weights (fp8/weights.py), or Nones
    return _FP8MLP.apply(x, w1, b1, w2, s1, s2, act, *c1, *c2)


def reference_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b1: Optional[torch.Tensor] = None,
                  act: int = SWIGLU) -> torch.Tensor:
    return F.linear(activation(F.linear(x, w1, b1), act), w2)

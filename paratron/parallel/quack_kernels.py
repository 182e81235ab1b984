"""paratron's uses of quack's CuTe-DSL kernels on Hopper in bf16 training: the SwiGLU MLP with the
activation inside the GEMMs, and RMSNorm.

MLP. The plain path runs fc1's GEMM, a SwiGLU kernel over its [tokens, 2F] output and fc2's GEMM; its
backward runs fc2's input-gradient GEMM, the SwiGLU backward kernel, and the weight GEMMs. Here
fc1's GEMM applies SwiGLU in its epilogue (``gemm_gated``: it writes the pre-activation, kept for
the backward, and the activation, fc2's input), and fc2's input-gradient GEMM applies the SwiGLU
backward in its epilogue (``gemm_dgated``: from the kept pre-activation it writes d[gate, up]). The two
elementwise passes over the [tokens, 2F] tensor are gone. The forward's activation (fc2's input) is kept for
fc2's weight gradient, and the backward's kernel is quack's without the store that would write it again
(quack_dgated.py: 557 against 514 TFLOP/s at the power cap, +[tokens, F] bf16 of memory per layer;
``PARATRON_KEEP_SWIGLU_ACT=0`` keeps only the pre-activation, and quack's kernel rewrites the activation).
The weight gradients go into ``main_grad`` by quack's GEMM adding into it (``quack_gemm.gemm_accumulate``,
fc1's in the [gate; up] order) where the tiles ``wgrad_fc1`` / ``wgrad_fc2`` are not off.

The kernels read fc1's weight, stored [gate; up] (paratron's and Megatron's layout), as interleaved
rows ``concat_layout=("B",)``: the pre-activation and its gradient are [g0, u0, g1, u1, ...] along the
last dimension, and fc1's two backward GEMMs take them in that order (``concat_layout`` again).

quack-kernels (Tri Dao's CuTe-DSL kernel library, https://github.com/Dao-AILab/quack) is an optional
dependency: without it, on CPUs, on GPUs other than Hopper, with FP8, biases or a SwiGLU variant, and
with ``PARATRON_GATED_GEMM=0``, the MLP runs the plain path. The torch expressions below (``*_ref``)
are the same operations in the same layout; the CPU tests run the autograd function on them.

RMSNorm: quack's forward and backward kernels (fp32 inside; the weight gradient from per-block
partial sums) in place of the compiled torch expression: 0.42 against 0.56 ms forward + backward at
llama-1b's [32768, 2048] on an H100 (benchmarks/results/gated_mlp_llama-1b_20261126_040022.md).
``PARATRON_QUACK_NORM=0`` turns it off. Generation (no autograd) takes the torch paths.
``rms_norm_keep`` also hands the norm's input on as the block's residual, so that the residual's gradient
arrives in the norm's backward, whose kernel adds it to dx (``dresidual_out``): the separate add of the two
gradients of the residual stream (12.6 ms per 65,536 tokens on llama-1b, at 3 TB/s) is gone.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import quack_dgated, quack_gemm
from .grad_accumulation import main_grad_of, residual_addmm, wgrad_accumulate

try:  # optional: pip install quack-kernels (Hopper); used only on CUDA
    from quack import rmsnorm as _q_rmsnorm
    from quack.rmsnorm import rmsnorm_bwd as _q_rmsnorm_bwd, rmsnorm_fwd as _q_rmsnorm_fwd
    from quack.gemm_interface import gemm as _q_gemm, gemm_act as _q_gemm_act
except Exception:  # noqa: BLE001 - not installed, or its CUDA libraries do not load on this machine
    _q_gemm = None

KEEP_ACT = os.environ.get("PARATRON_KEEP_SWIGLU_ACT", "1") != "0"  # read once, like the tiles


def hopper_bf16(device, dtype, switch: str) -> bool:
    """A module built on ``device`` in ``dtype`` may take an optional Hopper kernel: bf16 on a Hopper GPU,
    and the environment ``switch`` not 0."""
    if dtype != torch.bfloat16 or os.environ.get(switch, "1") == "0":
        return False
    device = torch.device(device) if device is not None else torch.device("cpu")
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def on_hopper(device, dtype, switch: str) -> bool:
    """quack's kernels can run for a module built on ``device`` in ``dtype``: quack importable and
    ``hopper_bf16``."""
    return _q_gemm is not None and hopper_bf16(device, dtype, switch)


def wanted(fused_swiglu: bool, bias: bool, device, dtype) -> Optional[str]:
    """Whether an MLP built on ``device`` in ``dtype`` takes the gated GEMMs: the fused SwiGLU (no offset,
    clamp or --no-bias-swiglu-fusion), no biases, ``on_hopper`` with ``PARATRON_GATED_GEMM``. Decided when
    the model is built (its device is known there, and the compiled forward then only reads the
    answer). The answer names the library of fc1's weight-gradient GEMM: "cublas" (fusable into main_grad),
    or "quack" with ``PARATRON_GATED_BWD=quack``; None: the plain path."""
    if not (fused_swiglu and not bias and on_hopper(device, dtype, "PARATRON_GATED_GEMM")):
        return None
    return "quack" if os.environ.get("PARATRON_GATED_BWD") == "quack" else "cublas"


def applies(x: torch.Tensor, fc1, fc2) -> bool:
    """For an MLP that ``wanted`` the gated GEMMs: training (the kernels keep the pre-activation for the
    backward; generation takes the plain path), no FP8 state, widths the kernels' 16-byte loads take."""
    return (torch.is_grad_enabled() and x.is_cuda and fc1.fp8 is None and fc2.fp8 is None
            and fc1.weight.size(1) % 8 == 0 and fc2.weight.size(0) % 8 == 0 and fc2.weight.size(1) % 8 == 0)


# ---- the operations, as torch expressions (the reference; CPU tests) ---------------------------
def interleave(w1: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows -> [g0, u0, g1, u1, ...] rows."""
    return w1.unflatten(0, (2, -1)).transpose(0, 1).flatten(0, 1)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] rows -> [gate; up] rows."""
    return t.unflatten(0, (-1, 2)).transpose(0, 1).flatten(0, 1)


def gated_ref(x: torch.Tensor, w1: torch.Tensor):
    """(pre-activation [M, 2F] interleaved, silu(gate) * up [M, F])."""
    pre = (x.float() @ interleave(w1).float().t())
    act = torch.nn.functional.silu(pre[:, 0::2]) * pre[:, 1::2]
    return pre.to(x.dtype), act.to(x.dtype)


def dgated_ref(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor):
    """(d pre-activation [M, 2F] interleaved, the activation [M, F] recomputed from ``pre``)."""
    dact = dy.float() @ w2.float()
    gate, up = pre[:, 0::2].float(), pre[:, 1::2].float()
    sig = torch.sigmoid(gate)
    dpre = torch.stack((dact * up * sig * (1 + gate * (1 - sig)), dact * gate * sig), dim=-1).flatten(1)
    return dpre.to(dy.dtype), (gate * sig * up).to(dy.dtype)


def _gated(x: torch.Tensor, w1: torch.Tensor):
    """fc1 + SwiGLU: quack's gemm_gated on CUDA, the reference elsewhere."""
    if not x.is_cuda:
        return gated_ref(x, w1)
    return _q_gemm_act(x, w1.t(), activation="swiglu", concat_layout=("B",), tuned=False)


def _dgated(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor):
    """fc2's input gradient + SwiGLU's backward: quack's gemm_dgated on CUDA, the reference elsewhere."""
    if not dy.is_cuda:
        return dgated_ref(dy, w2, pre)
    return quack_gemm.gemm_dgated(dy, w2, pre, quack_gemm.tile("dgated"))


def _dgated_keep(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """d pre-activation only (the activation kept from the forward): quack_dgated's kernel on CUDA, the
    reference elsewhere."""
    if not dy.is_cuda:
        return dgated_ref(dy, w2, pre)[0]
    return quack_dgated.dgated_keep(dy, w2, pre, quack_gemm.tile("dgated"))


def _keeps_act(x: torch.Tensor) -> bool:
    """The forward keeps the activation for the backward: ``KEEP_ACT``, and on CUDA the kernel without the
    activation's store imported (the gated path runs only where ``wanted`` found Hopper; CPUs: the reference
    path, the same bookkeeping). No device query here: this runs inside compiled forwards."""
    return KEEP_ACT and (not x.is_cuda or quack_dgated.IMPORTED)


def _wgrad(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, interleaved: bool) -> None:
    """``main_grad += dy^T x`` (rows de-interleaved with ``interleaved``): quack's GEMM adding into the buffer
    where its tiles (``wgrad_fc1`` / ``wgrad_fc2``) are not off and it runs, else cuBLAS (grad_accumulation)."""
    spec = quack_gemm.tile("wgrad_fc1" if interleaved else "wgrad_fc2")
    if quack_gemm.accumulate_applies(main_grad, dy, spec):
        quack_gemm.gemm_accumulate(main_grad, dy, x, interleaved, spec)
    else:
        wgrad_accumulate(main_grad, dy, x, interleaved)


def _dx(dpre: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """fc1's input gradient from the interleaved ``dpre``: on CUDA quack's GEMM reading the weight in the
    interleaved order in place (quack_gemm.py, the ``dx`` tiles); with ``dx=off``, and on CPUs, a matmul
    with fc1's weight re-ordered by a copy."""
    spec = quack_gemm.tile("dx")
    if dpre.is_cuda and spec != "off":
        return quack_gemm.gemm_interleaved(dpre, w1, spec)
    return dpre @ interleave(w1)


def _dw1(dpre: torch.Tensor, x: torch.Tensor, bwd: str) -> torch.Tensor:
    """fc1's weight gradient in the [gate; up] order: cuBLAS + a re-ordering copy, or with ``bwd="quack"``
    (CUDA) quack's GEMM writing the [gate; up] order itself."""
    if bwd == "quack" and dpre.is_cuda:
        return _q_gemm(dpre.t(), x, concat_layout=("out",), dynamic_scheduler=True, tuned=False)
    return deinterleave(dpre.t() @ x)


class _GatedMLP(torch.autograd.Function):
    """y = swiglu(x W1^T) W2^T (+ residual) on 2-D ``x``; keeps x and the pre-activation. ``g1`` / ``g2``:
    the weights' ``main_grad`` when their gradients are added there by this backward (gradient-accumulation
    fusion, paratron/parallel/grad_accumulation.py; autograd then gets placeholders), else None."""

    @staticmethod
    def forward(ctx, x, w1, w2, residual, bwd, g1, g2):
        pre, act = _gated(x, w1)
        if residual is None:
            y = act @ w2.t()
        else:  # C read by the GEMM, not copied into the output first
            y = residual_addmm(residual, act, w2)
        ctx.save_for_backward(x, w1, w2, pre, act if _keeps_act(x) else None)
        ctx.main_grads = g1, g2  # (not saved: they change as they accumulate, by design)
        ctx.has_residual, ctx.bwd = residual is not None, bwd
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, w1, w2, pre, act), (g1, g2) = ctx.saved_tensors, ctx.main_grads
        dy = dy.contiguous()
        if act is None:
            dpre, act = _dgated(dy, w2, pre)
        else:
            dpre = _dgated_keep(dy, w2, pre)
        if g2 is None:
            dw2 = dy.t() @ act
        else:
            _wgrad(g2, dy, act, False)
            dw2 = torch.empty_like(w2)
        if g1 is None:
            dw1 = _dw1(dpre, x, ctx.bwd)
        else:  # added to main_grad in the [gate; up] order (the MLP marks fc1's weight fusable unless
            # PARATRON_GATED_BWD=quack asked for the unfused quack GEMM)
            _wgrad(g1, dpre, x, True)
            dw1 = torch.empty_like(w1)
        return _dx(dpre, w1), dw1, dw2, (dy if ctx.has_residual else None), None, None, None


def gated_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              residual: Optional[torch.Tensor] = None, bwd: str = "cublas") -> torch.Tensor:
    """``silu(gate) * up`` MLP of ``x [..., H]`` with fc1's weight ``w1 [2F, H]`` ([gate; up] rows) and fc2's
    ``w2 [H, F]``; ``residual`` (x's shape) is added by fc2's GEMM; ``bwd``: see ``_dw1``."""
    shape = x.shape
    res = None if residual is None else residual.reshape(-1, w2.size(0))
    return _GatedMLP.apply(x.reshape(-1, shape[-1]), w1, w2, res, bwd, main_grad_of(w1),
                           main_grad_of(w2)).view(*shape[:-1], w2.size(0))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` scaled by ``weight`` on quack's kernel (fp32 inside, one rounding; the Norm's
    torch expression rounds the normalised value before the weight multiplies it). For modules that
    ``on_hopper`` allowed."""
    return _q_rmsnorm(x, weight, eps=eps)


def norm_keep_ref(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm of 2-D ``x`` as quack computes it (fp32 inside, one rounding), 1 / rms per row)."""
    rstd = torch.rsqrt(x.float().square().mean(-1) + eps)
    return (x.float() * rstd[:, None] * weight.float()).to(x.dtype), rstd


def norm_keep_bwd_ref(x, weight, dout, rstd, dres):
    """RMSNorm's (dx + ``dres``, dweight), fp32 inside, one rounding of dx."""
    xhat, g = x.float() * rstd[:, None], dout.float() * weight.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dres is not None:
        dx = dx + dres.float()
    return dx.to(x.dtype), (dout.float() * xhat).sum(0).to(weight.dtype)


class _NormKeep(torch.autograd.Function):
    """(RMSNorm(x), x): the second output is ``x`` itself (a view), the residual of a pre-norm block, so
    that both of x's gradients arrive here and one kernel sums them."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.reshape(-1, x.size(-1))
        if x.is_cuda:
            out, _, rstd = _q_rmsnorm_fwd(x2, weight, eps=eps, store_rstd=True)
        else:
            out, rstd = norm_keep_ref(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return out.view(x.shape), x.view_as(x)

    @staticmethod
    def backward(ctx, dout, dres):
        x2, weight, rstd = ctx.saved_tensors
        shape = dout.shape
        dout = dout.reshape(x2.shape).contiguous()
        dres = None if dres is None else dres.reshape(x2.shape).contiguous()
        if x2.is_cuda:
            dx, dw, _, _ = _q_rmsnorm_bwd(x2, weight, dout, rstd, dres)
        else:
            dx, dw = norm_keep_bwd_ref(x2, weight, dout, rstd, dres)
        return dx.view(shape), dw, None


def rms_norm_keep(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(x) as ``rms_norm``, x as the residual): the residual's gradient joins x's in the norm's
    backward kernel. ``x`` contiguous."""
    return _NormKeep.apply(x.contiguous(), weight, eps)

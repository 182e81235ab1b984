"""quack's CuTe-DSL kernels on Hopper in bf16 training: the SwiGLU MLP with the activation inside the GEMMs
(the ``--kernel-gated-mlp`` switch).

MLP. The plain path runs fc1's GEMM, a SwiGLU kernel over its [tokens, 2F] output and fc2's GEMM; its
backward runs fc2's input-gradient GEMM, the SwiGLU backward kernel, and the weight GEMMs. Here
fc1's GEMM applies SwiGLU in its epilogue (``gemm_gated``: it writes the pre-activation, kept for
the backward, and the activation, fc2's input), and fc2's input-gradient GEMM applies the SwiGLU
backward in its epilogue (``gemm_dgated``: from the kept pre-activation it writes d[gate, up]). The two
elementwise passes over the [tokens, 2F] tensor are gone. The forward's activation (fc2's input) is kept for
fc2's weight gradient, and the backward's kernel is quack's without the store that would write it again
(experimental/quack_dgated.py: faster at the cost of [tokens, F] bf16 of memory per layer,
benchmarks/results/backward_levers_20261126_1400.md;
``--kernel-keep-swiglu-activation off`` keeps only the pre-activation, and quack's kernel rewrites it).
The weight gradients go into ``main_grad`` by quack's GEMM adding into it (``quack_gemm.gemm_accumulate``,
fc1's in the [gate; up] order) where the tiles ``wgrad_fc1`` / ``wgrad_fc2`` are not off.

The kernels read fc1's weight, stored [gate; up] (paratron's and Megatron's layout), as interleaved
rows ``concat_layout=("B",)``: the pre-activation and its gradient are [g0, u0, g1, u1, ...] along the
last dimension, and fc1's two backward GEMMs take them in that order (``concat_layout`` again).

quack-kernels (Tri Dao's CuTe-DSL kernel library, https://github.com/Dao-AILab/quack) is an optional
dependency: without it, on CPUs, on GPUs other than Hopper, with FP8, biases or a SwiGLU variant, and
with ``--kernel-gated-mlp torch``, the MLP runs the plain path. The torch expressions below (``*_ref``)
are the same operations in the same layout; the CPU tests run the autograd function on them.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import quack_gemm
from .accumulate import residual_addmm, wgrad_accumulate
from .experimental import quack_dgated
from .hardware import hopper_bf16

try:  # optional: pip install quack-kernels (Hopper); used only on CUDA
    from quack.gemm_interface import gemm as _q_gemm, gemm_act as _q_gemm_act
except Exception:  # noqa: BLE001 - not installed, or its CUDA libraries do not load on this machine
    _q_gemm = None


def available(device, dtype) -> bool:
    """quack's GEMMs can run for a module built on ``device`` in ``dtype``: quack importable, bf16, Hopper."""
    return _q_gemm is not None and hopper_bf16(device, dtype)


def wanted(fused_swiglu: bool, bias: bool, device, dtype, wgrad: str = "cublas") -> Optional[str]:
    """Whether an MLP built on ``device`` in ``dtype`` can take the gated GEMMs: the fused SwiGLU (no offset,
    clamp or --no-bias-swiglu-fusion), no biases, ``available``. Decided when the model is built (its device
    is known there, and the compiled forward then only reads the answer). The answer names the library of
    fc1's weight-gradient GEMM (``wgrad``, the ``--kernel-gated-mlp-wgrad`` switch): "cublas" (fusable into
    main_grad) or "quack"; None: the plain path."""
    if not (fused_swiglu and not bias and available(device, dtype)):
        return None
    return wgrad


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


def _dgated(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, tiles: dict):
    """fc2's input gradient + SwiGLU's backward: quack's gemm_dgated on CUDA, the reference elsewhere."""
    if not dy.is_cuda:
        return dgated_ref(dy, w2, pre)
    return quack_gemm.gemm_dgated(dy, w2, pre, tiles["dgated"])


def _dgated_keep(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, tiles: dict) -> torch.Tensor:
    """d pre-activation only (the activation kept from the forward): quack_dgated's kernel on CUDA, the
    reference elsewhere."""
    if not dy.is_cuda:
        return dgated_ref(dy, w2, pre)[0]
    return quack_dgated.dgated_keep(dy, w2, pre, tiles["dgated"])


def _keeps_act(x: torch.Tensor, keep: bool) -> bool:
    """The forward keeps the activation for the backward: ``keep`` (``--kernel-keep-swiglu-activation``), and on
    CUDA the kernel without the activation's store imported (the gated path runs only where ``wanted`` found
    Hopper; CPUs: the reference path, the same bookkeeping). No device query here: this runs inside compiled
    forwards."""
    return keep and (not x.is_cuda or quack_dgated.IMPORTED)


def _wgrad(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, interleaved: bool, tiles: dict) -> None:
    """``main_grad += dy^T x`` (rows de-interleaved with ``interleaved``): quack's GEMM adding into the buffer
    where its tiles (``wgrad_fc1`` / ``wgrad_fc2``) are not off and it runs, else cuBLAS (accumulate.py)."""
    spec = tiles["wgrad_fc1" if interleaved else "wgrad_fc2"]
    if quack_gemm.accumulate_applies(main_grad, dy, spec):
        quack_gemm.gemm_accumulate(main_grad, dy, x, interleaved, spec)
    else:
        wgrad_accumulate(main_grad, dy, x, interleaved)


def _dx(dpre: torch.Tensor, w1: torch.Tensor, tiles: dict) -> torch.Tensor:
    """fc1's input gradient from the interleaved ``dpre``: on CUDA quack's GEMM reading the weight in the
    interleaved order in place (quack_gemm.py, the ``dx`` tiles); with ``dx=off``, and on CPUs, a matmul
    with fc1's weight re-ordered by a copy."""
    spec = tiles["dx"]
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
    fusion, paratron/parallel/linear.py; autograd then gets placeholders), else None. ``bwd``: fc1's
    weight-gradient library; ``keep``: keep the activation; ``tiles``: the GEMM tiles as (use, spec) pairs;
    ``lt``: the ``--kernel-cublaslt`` switch of fc2's residual GEMM where quack's does not run."""

    @staticmethod
    def forward(ctx, x, w1, w2, residual, g1, g2, bwd, keep, tiles, lt):
        pre, act = _gated(x, w1)
        if residual is None:
            y = act @ w2.t()
        else:  # C read by the GEMM, not copied into the output first
            y = residual_addmm(residual, act, w2, lt)
        ctx.save_for_backward(x, w1, w2, pre, act if _keeps_act(x, keep) else None)
        ctx.main_grads = g1, g2  # (not saved: they change as they accumulate, by design)
        ctx.has_residual, ctx.bwd, ctx.tiles = residual is not None, bwd, tiles
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, w1, w2, pre, act), (g1, g2), tiles = ctx.saved_tensors, ctx.main_grads, dict(ctx.tiles)
        dy = dy.contiguous()
        if act is None:
            dpre, act = _dgated(dy, w2, pre, tiles)
        else:
            dpre = _dgated_keep(dy, w2, pre, tiles)
        if g2 is None:
            dw2 = dy.t() @ act
        else:
            _wgrad(g2, dy, act, False, tiles)
            dw2 = torch.empty_like(w2)
        if g1 is None:
            dw1 = _dw1(dpre, x, ctx.bwd)
        else:  # added to main_grad in the [gate; up] order (the MLP marks fc1's weight fusable unless
            # --kernel-gated-mlp-wgrad quack asked for the unfused quack GEMM)
            _wgrad(g1, dpre, x, True, tiles)
            dw1 = torch.empty_like(w1)
        return _dx(dpre, w1, tiles), dw1, dw2, (dy if ctx.has_residual else None), None, None, None, None, None, None


def tile_pairs(overrides: Optional[dict] = None) -> tuple:
    """The GEMM tiles (``quack_gemm.tiles``, with ``--kernel-quack-tiles``' overrides) as sorted (use, spec) pairs:
    the form the autograd function takes (a constant a compiled forward reads). Made once, when the MLP is built."""
    return tuple(sorted(quack_gemm.tiles(overrides).items()))


def gated_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, residual: Optional[torch.Tensor] = None,
              bwd: str = "cublas", main_grads: tuple = (None, None), keep_act: bool = True,
              tiles: Optional[dict] = None, cublaslt: bool = True) -> torch.Tensor:
    """``silu(gate) * up`` MLP of ``x [..., H]`` with fc1's weight ``w1 [2F, H]`` ([gate; up] rows) and fc2's
    ``w2 [H, F]``; ``residual`` (x's shape) is added by fc2's GEMM; ``bwd``: see ``_dw1``; ``main_grads``: the
    weights' fp32 gradient buffers their backward adds into (None: autograd's gradients); ``keep_act``: keep
    the activation for fc2's weight gradient; ``tiles``: ``tile_pairs()`` of the run's tiles (None: the defaults);
    ``cublaslt``: the ``--kernel-cublaslt`` switch of fc2's GEMM with the residual."""
    shape = x.shape
    res = None if residual is None else residual.reshape(-1, w2.size(0))
    pairs = tile_pairs() if tiles is None else tiles
    y = _GatedMLP.apply(x.reshape(-1, shape[-1]), w1, w2, res, *main_grads, bwd, keep_act, pairs, cublaslt)
    return y.view(*shape[:-1], w2.size(0))

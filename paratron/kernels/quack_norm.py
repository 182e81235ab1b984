"""quack's RMSNorm kernels on Hopper in bf16 training: forward and backward (fp32 inside; the weight gradient
from per-block partial sums) in place of the compiled torch expression (the ``--kernel-rmsnorm`` switch;
paratron/model/layers.py ``Norm`` decides per module). ``rms_norm_keep`` also hands the norm's input on as the
block's residual, so that the residual's gradient arrives in the norm's backward, whose kernel adds it to dx
(``dresidual_out``): the separate add of the two gradients of the residual stream is gone. The torch
expressions (``norm_keep_ref``, ``norm_keep_bwd_ref``) are the references, and what the autograd function runs
on CPUs. Generation (no autograd) takes the torch paths. quack-kernels is optional (``paratron[hopper]``).
"""
from __future__ import annotations

import torch

from .hardware import hopper_bf16

try:  # optional: pip install quack-kernels (Hopper); used only on CUDA
    from quack import rmsnorm as _q_rmsnorm
    from quack.rmsnorm import rmsnorm_bwd as _q_rmsnorm_bwd, rmsnorm_fwd as _q_rmsnorm_fwd
except Exception:  # noqa: BLE001 - not installed, or its CUDA libraries do not load on this machine
    _q_rmsnorm = None


def available(device, dtype) -> bool:
    """quack's RMSNorm can run for a module built on ``device`` in ``dtype``: quack importable, bf16, Hopper."""
    return _q_rmsnorm is not None and hopper_bf16(device, dtype)
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

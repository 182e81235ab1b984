"""The model's norms: LayerNorm / RMSNorm in fp32 (zero-centred with --apply-layernorm-1p), quack's RMSNorm
kernel in training where it runs."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..config.kernels import KernelConfig
from ..kernels import quack_norm
from ..parallel.sharding import ShardSpec, set_spec


class Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight), computed in fp32. ``zero_centered``
    (``--apply-layernorm-1p``): the weight is stored as w, initialised to 0, and applied as 1 + w."""

    def __init__(self, kind: str, size: int, eps: float, sequence_parallel: bool = False, device=None, dtype=None,
                 zero_centered: bool = False, kernel: str = "auto"):
        super().__init__()
        self.kind, self.eps, self.size, self.zero_centered = kind, eps, (size,), zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(size, device=device, dtype=dtype))
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        # applied to a share of the activations (sequence or heads): partial gradients per TP rank
        if sequence_parallel:
            for p in self.parameters():
                set_spec(p, ShardSpec(sum_over=("tp",)))
        # quack's RMSNorm kernel in training (Hopper, bf16, rows of whole 16-byte vectors; ``kernel``: the
        # --kernel-rmsnorm switch)
        self.quack = (kernel != "torch" and kind == "RMSNorm" and not zero_centered and size % 8 == 0
                      and quack_norm.available(device, dtype))

    @classmethod
    def of(cls, cfg: ModelConfig, size: int, sequence_parallel: bool = False, device=None, dtype=None,
           kernels: Optional[KernelConfig] = None) -> "Norm":
        """The model's norm (--normalization, --norm-epsilon, --apply-layernorm-1p) over ``size`` features;
        ``kernels``: the switches (--kernel-rmsnorm)."""
        return cls(cfg.normalization, size, cfg.norm_epsilon, sequence_parallel, device, dtype,
                   zero_centered=cfg.apply_layernorm_1p, kernel=(kernels or KernelConfig()).kernel_rmsnorm)

    @property
    def plain_rms(self) -> bool:
        """An RMSNorm whose weight applies as stored (not zero-centred): what a kernel fusing the norm computes."""
        return self.kind == "RMSNorm" and not self.zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:  # 1 + w in fp32, as Transformer Engine's zero-centred-gamma kernels
            gamma = self.weight.float() + 1.0
            if self.kind == "LayerNorm":
                return F.layer_norm(x.float(), self.size, gamma, self.bias.float(), self.eps).to(x.dtype)
            return (gamma * F.rms_norm(x.float(), self.size, eps=self.eps)).to(x.dtype)
        if self.kind == "LayerNorm":
            return F.layer_norm(x, self.size, self.weight, self.bias, self.eps)
        if self.quack and torch.is_grad_enabled() and x.is_cuda:  # (generation: the torch expression)
            return quack_norm.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.size, eps=self.eps).to(x.dtype)

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x), x) for a pre-norm block whose residual is ``x``: on quack's kernel (training) the
        residual's gradient is added to x's by the norm's backward kernel instead of a separate add."""
        if self.quack and torch.is_grad_enabled():  # (quack is only ever set for a CUDA module)
            return quack_norm.rms_norm_keep(x, self.weight, self.eps)
        return self(x), x


class GatedRMSNorm(nn.Module):
    """The gated RMSNorm of Mamba-2 and Gated DeltaNet, in fp32 over groups of ``group_size`` features (a Mamba-2
    group's channels; a DeltaNet value head): ``before_gate`` False (Mamba-2): w * rms_norm(y * silu(z)); True
    (Gated DeltaNet): w * rms_norm(y) * silu(z). ``weight``: the parameter (split over TP by the mixer, or
    ``size`` ones replicated); ``partial``: applied to a share of the heads under TP, so its gradient is summed
    over TP."""

    def __init__(self, size: int, group_size: int, eps: float, before_gate: bool, weight: Optional[nn.Parameter] = None,
                 partial: bool = False, device=None, dtype=None):
        super().__init__()
        self.group_size, self.eps, self.before_gate = group_size, eps, before_gate
        self.weight = weight if weight is not None else nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        if partial:
            set_spec(self.weight, ShardSpec(sum_over=("tp",)))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype, gate = y.dtype, F.silu(z.float())
        y = y.float() if self.before_gate else y.float() * gate
        shape = y.shape
        y = F.rms_norm(y.reshape(*shape[:-1], -1, self.group_size), (self.group_size,), eps=self.eps).reshape(shape)
        if self.weight.numel() == self.group_size:  # one weight for every head
            y = (y.reshape(*shape[:-1], -1, self.group_size) * self.weight.float()).reshape(shape)
        else:
            y = y * self.weight.float()
        return (y * gate if self.before_gate else y).to(dtype)

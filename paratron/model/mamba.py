"""The Mamba-2 mixer of hybrid stacks (Megatron's MambaMixer, Hugging Face's Mamba2Mixer): in-projection to
z, x, B, C, dt; a short causal depthwise convolution over [x, B, C] with SiLU; the selective state-space scan
(SSD, kernels/ssd.py) with the D skip; the gated RMSNorm; the out-projection.

Shapes: d_inner = heads x --mamba-head-dim channels, heads in --mamba-num-groups groups sharing one B and one C
of --mamba-state-dim each. Tensor parallelism splits whole heads and groups: in_proj's rows are the blocks
[z | x | B | C | dt], each cut over the TP ranks (Megatron's layout), so every rank holds its heads' z and x, its
groups' B and C, its heads' dt; the convolution, dt_bias, A_log, D and the norm are split the same way, and the
norm's groups stay whole on one rank. Under sequence parallelism in_proj gathers the sequence and out_proj
reduce-scatters it, as attention's projections do. Context parallelism (Megatron's Mamba CP) splits a TP rank's
heads and groups once more: each CP rank convolves and scans the whole sequence of its share (``forward``).

Packed documents (``ctx.document_ids``) reset the convolution and the scan at each document start. In
generation ``ctx.kv_cache`` holds this layer's convolution and SSM states (paratron/inference/cache.py); when its
view has ``cu_seqlens`` (the paged engine's packed prompt chunks) the pass is one row of several requests, each
going on from its own states (kernels/varlen.py).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import mup
from ..config import ModelConfig
from ..config.check_hybrid import mamba_heads
from ..kernels.causal_conv import causal_conv
from ..kernels.linear_scan import fla_usable, ssd
from ..kernels.ssd import resets_of
from ..parallel.context import channels_to_sequence, sequence_to_channels, share_rows
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, init_normal, tp_param
from .context import ForwardContext, Parallel
from .mlp import output_init
from .norms import GatedRMSNorm

CONV_WIDTH = 4  # Megatron's and Hugging Face's d_conv
DT_RANGE, DT_FLOOR, A_RANGE = (1e-3, 0.1), 1e-4, (1.0, 16.0)  # Megatron's initialisation ranges


def conv_params(channels: int, blocks: tuple, width: int, par: Parallel, device, dtype, bias: bool = True) -> tuple:
    """The depthwise convolution's weight [channels, 1, width] and bias (None without), nn.Conv1d's
    initialisation, split over TP in ``blocks``."""
    bound = 1 / math.sqrt(width)
    w = torch.empty(channels, 1, width, device=device, dtype=dtype).uniform_(-bound, bound)
    if not bias:
        return tp_param(w, par.tp_group, blocks), None
    b = torch.empty(channels, device=device, dtype=dtype).uniform_(-bound, bound)
    return tp_param(w, par.tp_group, blocks), tp_param(b, par.tp_group, blocks)


def decay_params(heads: int, par: Parallel, device, dtype, a_range=A_RANGE) -> tuple:
    """dt_bias (softplus(dt_bias) log-uniform in Megatron's dt range) and A_log (A uniform in ``a_range``)."""
    dt = torch.exp(torch.rand(heads, device=device) * (math.log(DT_RANGE[1]) - math.log(DT_RANGE[0]))
                   + math.log(DT_RANGE[0])).clamp(min=DT_FLOOR)
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(dtype)  # softplus's inverse
    a_log = torch.empty(heads, device=device).uniform_(*a_range).log().to(dtype)
    return tp_param(dt_bias, par.tp_group), tp_param(a_log, par.tp_group)


def use_fla(par: Parallel) -> bool:
    """The --kernel-linear-scan switch asks for fla, or auto where fla-core is installed and can train here
    (kernels/linear_scan.fla_refusal; CUDA checked per call)."""
    asked = par.kernels.kernel_linear_scan
    return asked == "fla" or (asked == "auto" and fla_usable())


class MambaMixer(nn.Module):
    """Mamba-2 (SSD) mixer: forward(x [s, b, hidden], ctx, residual) -> [s, b, hidden]."""

    takes_residual = True  # out_proj adds the residual

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None, layer_index: int = 0):
        super().__init__()
        tp, self.layer_index, self.chunk = par.tp_size, layer_index, cfg.mamba_chunk_size
        self.dt_min = cfg.mamba_dt_limit_min
        heads, self.p, self.n = mamba_heads(cfg), cfg.mamba_head_dim, cfg.mamba_state_dim
        groups, d_inner = cfg.mamba_num_groups, mamba_heads(cfg) * cfg.mamba_head_dim
        self.heads, self.groups, self.d_inner = heads // tp, groups // tp, d_inner // tp
        bc = groups * self.n
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, 2 * d_inner + 2 * bc + heads, tp_group=par.tp_group,
                                            bias=False, sequence_parallel=par.sequence_parallel,
                                            blocks=(d_inner, d_inner, bc, bc, heads),
                                            init_method=init_normal(mup.hidden_std(cfg)), device=device, dtype=dtype)
        self.conv1d_weight, self.conv1d_bias = conv_params(d_inner + 2 * bc, (d_inner, bc, bc), CONV_WIDTH, par,
                                                           device, dtype)
        self.dt_bias, self.A_log = decay_params(heads, par, device, dtype)
        self.D = tp_param(torch.ones(heads, device=device, dtype=dtype), par.tp_group)
        norm_weight = tp_param(torch.ones(d_inner, device=device, dtype=dtype), par.tp_group)
        self.norm = GatedRMSNorm(d_inner, d_inner // groups, cfg.norm_epsilon, before_gate=False, weight=norm_weight)
        self.out_proj = RowParallelLinear(d_inner, cfg.hidden_size, tp_group=par.tp_group, bias=False,
                                          sequence_parallel=par.sequence_parallel, init_method=output_init(cfg),
                                          device=device, dtype=dtype)
        self.fla = use_fla(par)
        self.recompute = par.kernels.kernel_linear_scan_recompute == "on"

    def state_shapes(self, batch: int) -> tuple[tuple, tuple]:
        """Generation's cache of this layer (this TP rank's share): the convolution's last inputs, the SSM state."""
        return (batch, CONV_WIDTH - 1, self.d_inner + 2 * self.groups * self.n), (batch, self.heads, self.p, self.n)

    def _shares(self, cp) -> tuple:
        """(heads, groups, conv weight, conv bias, dt_bias, A_log, D) of what this rank scans: its TP share, of
        which under context parallelism (``cp``) its CP share of the heads and groups."""
        params = (self.conv1d_weight, self.conv1d_bias, self.dt_bias, self.A_log, self.D)
        if cp is None:
            return (self.heads, self.groups) + params
        n, r, bc = cp.size, cp.rank, self.groups * self.n
        conv = tuple(share_rows(t, (self.d_inner, bc, bc), n, r) for t in params[:2])
        return (self.heads // n, self.groups // n) + conv + tuple(share_rows(t, (self.heads,), n, r)
                                                                  for t in params[2:])

    def forward(self, x: torch.Tensor, ctx: ForwardContext, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Under context parallelism (``ctx.cp``) one all-to-all gives each CP rank the whole sequence of 1/CP of
        the heads and groups (x, B, C, dt; z stays), the convolution and the scan run on it, and one all-to-all
        brings the result back to this rank's tokens before the gated norm."""
        di, bc, cp = self.d_inner, self.groups * self.n, ctx.cp
        z, xbc, dt = self.in_proj(x).transpose(0, 1).split([di, di + 2 * bc, self.heads], dim=-1)  # [b, s, ...]
        if cp is not None:
            *xbc, dt = channels_to_sequence(list(xbc.split([di, bc, bc], dim=-1)) + [dt], cp.size, cp.group)
            xbc = torch.cat(xbc, dim=-1)
        h, g, conv_w, conv_b, dt_bias, a_log, d_skip = self._shares(cp)
        b, s = xbc.shape[:2]
        cache = ctx.kv_cache.recurrent(self.layer_index) if ctx.kv_cache is not None else None
        reset = cache.reset if cache is not None else resets_of(ctx.document_ids)  # (ids: of the whole sequence)
        cu = cache.cu_seqlens if cache is not None else None  # packed requests, a state each (paged engine)
        xbc, conv_state = causal_conv(xbc, conv_w, conv_b, reset, cache.conv if cache is not None else None, cu)
        xs, B, C = F.silu(xbc).split([h * self.p, g * self.n, g * self.n], dim=-1)
        dt = F.softplus(dt.float() + dt_bias.float())
        if self.dt_min > 0:
            dt = dt.clamp(min=self.dt_min)
        A = -torch.exp(a_log.float())
        xs = xs.reshape(b, s, h, self.p).float()  # one fp32 copy: the scan's input and the D skip's
        y, state = ssd(xs, dt, A, B.reshape(b, s, g, self.n).float(), C.reshape(b, s, g, self.n).float(), reset,
                       cache.ssm if cache is not None else None, self.chunk,
                       "fla" if self.fla and x.is_cuda else "torch", self.recompute, cu)
        if cache is not None:
            cache.update(conv_state, state)
        y = (y + xs * d_skip.float()[:, None]).reshape(b, s, h * self.p).to(x.dtype)
        if cp is not None:
            y = sequence_to_channels(y, cp.size, cp.group)
        return self.out_proj(self.norm(y, z).transpose(0, 1), residual)

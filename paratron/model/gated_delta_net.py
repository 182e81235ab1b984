"""The Gated DeltaNet mixer (Qwen3-Next's linear attention; Megatron's ``--experimental-attention-variant
gated_delta_net`` and hybrid symbol G): in-projection to q, k, v, the output gate z, beta and alpha; a short
causal convolution over [q, k, v] (no bias) with SiLU; L2-normalised q and k; the gated delta rule
(kernels/gated_delta.py) with beta = sigmoid(b) and the log-decay g = -exp(A_log) softplus(alpha + dt_bias); a
per-head RMSNorm gated by silu(z); the out-projection.

Sizes are Megatron's --linear-* flags: --linear-num-key-heads query/key heads of --linear-key-head-dim,
--linear-num-value-heads value heads of --linear-value-head-dim (each key head serves value/key consecutive
value heads), a convolution of --linear-conv-kernel-dim taps. in_proj's rows are the blocks [q | k | v | z | beta
| alpha], each cut over TP (Megatron's layout): a rank holds whole key heads with the value heads they serve.
Packed documents reset the convolution and the recurrence; generation keeps both states in ``ctx.kv_cache``.
Context parallelism hands each CP rank the whole sequence of its share of the key heads (``forward``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import mup
from ..config import ModelConfig
from ..config.check_hybrid import gdn_chunk_size
from ..kernels.causal_conv import causal_conv
from ..kernels.linear_scan import gated_delta
from ..kernels.ssd import resets_of
from ..parallel.context import channels_to_sequence, sequence_to_channels, share_rows
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, init_normal
from .context import ForwardContext, Parallel
from .mamba import conv_params, decay_params, use_fla
from .mlp import output_init
from .norms import GatedRMSNorm

QK_NORM_EPS = 1e-6  # the L2 norm's epsilon (fla's, Megatron's and Qwen3-Next's)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's l2norm, which Megatron and Qwen3-Next use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + QK_NORM_EPS)


class GatedDeltaNet(nn.Module):
    """forward(x [s, b, hidden], ctx, residual) -> [s, b, hidden]."""

    takes_residual = True

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None, layer_index: int = 0):
        super().__init__()
        tp, self.layer_index, self.chunk = par.tp_size, layer_index, gdn_chunk_size(cfg)
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.nk, self.nv = nk // tp, nv // tp
        qk, v = nk * self.dk, nv * self.dv
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, 2 * qk + 2 * v + 2 * nv, tp_group=par.tp_group,
                                            bias=False, sequence_parallel=par.sequence_parallel,
                                            blocks=(qk, qk, v, v, nv, nv),
                                            init_method=init_normal(mup.hidden_std(cfg)), device=device, dtype=dtype)
        self.conv1d_weight, self.conv1d_bias = conv_params(2 * qk + v, (qk, qk, v), cfg.linear_conv_kernel_dim, par,
                                                           device, dtype, bias=False)  # (Megatron's, Qwen3-Next's)
        self.dt_bias, self.A_log = decay_params(nv, par, device, dtype)
        self.out_norm = GatedRMSNorm(self.dv, self.dv, cfg.norm_epsilon, before_gate=True, partial=tp > 1,
                                     device=device, dtype=dtype)
        self.out_proj = RowParallelLinear(v, cfg.hidden_size, tp_group=par.tp_group, bias=False,
                                          sequence_parallel=par.sequence_parallel, init_method=output_init(cfg),
                                          device=device, dtype=dtype)
        self.fla = use_fla(par)
        self.recompute = par.kernels.kernel_linear_scan_recompute == "on"
        self.conv_width = cfg.linear_conv_kernel_dim

    def state_shapes(self, batch: int) -> tuple[tuple, tuple]:
        """Generation's cache of this layer (this TP rank's share): the convolution's last inputs, the state."""
        return (batch, self.conv_width - 1, 2 * self.nk * self.dk + self.nv * self.dv), (batch, self.nv, self.dk,
                                                                                        self.dv)

    def _shares(self, cp) -> tuple:
        """(key heads, value heads, conv weight, dt_bias, A_log) of what this rank runs: its TP share, of which
        under context parallelism (``cp``) its CP share of the key heads with the value heads they serve."""
        if cp is None:
            return self.nk, self.nv, self.conv1d_weight, self.dt_bias, self.A_log
        n, r, qk = cp.size, cp.rank, self.nk * self.dk
        return (self.nk // n, self.nv // n, share_rows(self.conv1d_weight, (qk, qk, self.nv * self.dv), n, r),
                share_rows(self.dt_bias, (self.nv,), n, r), share_rows(self.A_log, (self.nv,), n, r))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Under context parallelism (``ctx.cp``) one all-to-all gives each CP rank the whole sequence of 1/CP of
        the key heads and their value heads (q, k, v, beta, alpha; z stays), the convolution and the delta rule
        run on it, and one all-to-all brings the result back to this rank's tokens before the gated norm."""
        qk, v, cp = self.nk * self.dk, self.nv * self.dv, ctx.cp
        qkv, z, beta, alpha = self.in_proj(x).transpose(0, 1).split([2 * qk + v, v, self.nv, self.nv], dim=-1)
        if cp is not None:
            *qkv, beta, alpha = channels_to_sequence(list(qkv.split([qk, qk, v], dim=-1)) + [beta, alpha], cp.size,
                                                     cp.group)
            qkv = torch.cat(qkv, dim=-1)
        nk, nv, conv_w, dt_bias, a_log = self._shares(cp)
        b, s = qkv.shape[:2]
        cache = ctx.kv_cache.recurrent(self.layer_index) if ctx.kv_cache is not None else None
        reset = cache.reset if cache is not None else resets_of(ctx.document_ids)  # (ids: of the whole sequence)
        cu = cache.cu_seqlens if cache is not None else None  # packed requests, a state each (paged engine)
        qkv, conv_state = causal_conv(qkv, conv_w, self.conv1d_bias, reset, cache.conv if cache is not None else None,
                                      cu)
        q, k, vs = F.silu(qkv).float().split([nk * self.dk, nk * self.dk, nv * self.dv], dim=-1)
        rep = nv // nk  # each key head serves this many consecutive value heads
        q, k = (l2_normalize(t.reshape(b, s, nk, self.dk)).repeat_interleave(rep, dim=2) for t in (q, k))
        g = -a_log.float().exp() * F.softplus(alpha.float() + dt_bias.float())
        o, state = gated_delta(q, k, vs.reshape(b, s, nv, self.dv), g, beta.float().sigmoid(), reset,
                               cache.ssm if cache is not None else None, self.chunk,
                               "fla" if self.fla and x.is_cuda else "torch", recompute=self.recompute, cu_seqlens=cu)
        if cache is not None:
            cache.update(conv_state, state)
        o = o.reshape(b, s, nv * self.dv).to(x.dtype)
        if cp is not None:
            o = sequence_to_channels(o, cp.size, cp.group)
        b, s = z.shape[:2]
        o = self.out_norm(o.reshape(b, s, self.nv, self.dv), z.reshape(b, s, self.nv, self.dv)).reshape(b, s, v)
        return self.out_proj(o.transpose(0, 1), residual)

"""Self-attention: projections -> q / k norms -> rotary -> core -> output gate -> output projection, with the core
chosen when the layer is built (``build_core``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import activation_offload as offload, mup
from ...config import ModelConfig
from ...kernels import flash_attention
from ...kernels.rotary import apply_rotary
from ...parallel.linear import mark_fusable
from ...parallel.tensor import ColumnParallelLinear, RowParallelLinear, init_normal
from ..context import ForwardContext, Parallel
from ..mlp import output_init
from ..norms import Norm
from ..rotary import apply_rotary_interleaved
from ..variants import apply_output_gate, qkv_parts
from .context_parallel import ContextParallelAttention
from .flash import FlashAttention
from .sdpa import SDPAttention
from .windowed import WindowedAttention, needs_core_attention, rope_layers


def rotation_of(cfg: ModelConfig, layer_index: int):
    """The rotary function of a layer: interleaved or rotate-half; None where --no-rope-freq makes it a NoPE
    layer."""
    if not rope_layers(cfg.no_rope_freq, cfg.num_layers)[min(layer_index, cfg.num_layers - 1)]:
        return None
    return apply_rotary_interleaved if cfg.rotary_interleaved else apply_rotary


def build_core(cfg: ModelConfig, par: Parallel, layer_index: int = 0, device=None, dtype=None,
               flash: Optional[bool] = None) -> SDPAttention:
    """The attention core of one layer: across the CP ranks when the model's sequence is split over them
    (``par.dims.cp`` > 1); the window / sink core when the config has a sliding window or a softmax variant;
    FlashAttention-4 where --attention-backend (auto, fused, flash) and the hardware allow it (``flash``: None as
    they say; True or False forces it, as tests do on the op's CPU reference); else SDPA."""
    args = (cfg, par, layer_index, device, dtype)
    if par.dims is not None and par.dims.cp > 1:
        return ContextParallelAttention(*args)
    if needs_core_attention(cfg):
        return WindowedAttention(*args)
    if flash is None:
        flash = (par.kernels.attention_backend in ("auto", "fused", "flash")
                 and flash_attention.wanted(cfg.kv_channels, device, dtype))
    if flash:  # the rotary embedding may join the op where q and k reach the core as projected
        return FlashAttention(*args, rotation=rotation_of(cfg, layer_index),
                              fusable=not (cfg.attention_output_gate or cfg.qk_layernorm))
    return SDPAttention(*args)


HALF = (torch.bfloat16, torch.float16)  # the activations' dtypes where auto takes the fused decode attention


class Attention(nn.Module):
    """Self-attention with grouped query heads; causal or masked as the forward context says.

    The fused QKV weight is laid out by query group, as Megatron's: for each group g, the rows of
    its ``heads/groups`` query heads, then its key head, then its value head (with
    ``--attention-output-gate``, as many gate heads between the queries and the key). A contiguous TP
    split therefore gives each rank whole groups with their queries.
    """

    takes_residual = True  # forward(x, ctx, residual): linear_proj adds it (in its matmul at TP=1)

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None, layer_index: int = 0):
        super().__init__()
        self.par = par
        self.d = cfg.kv_channels
        self.groups = cfg.num_query_groups // par.tp_size
        self.heads = cfg.num_attention_heads // par.tp_size
        self.q_per_group = cfg.num_attention_heads // cfg.num_query_groups
        self.recompute_core = False  # --recompute-granularity selective: the core again in backward
        self.layer_index = layer_index  # the global layer number (its slot in an inference KV cache)
        self.rotate = rotation_of(cfg, layer_index)  # the rotary embedding of this layer (None: NoPE)
        self.gated = cfg.attention_output_gate
        self.q_rows = self.q_per_group * qkv_parts(cfg)  # query (and gate) heads per group
        qkv_out = (cfg.num_attention_heads * qkv_parts(cfg) + 2 * cfg.num_query_groups) * self.d
        self.linear_qkv = ColumnParallelLinear(cfg.hidden_size, qkv_out, tp_group=par.tp_group,
                                               bias=(not cfg.disable_bias_linear) or cfg.add_qkv_bias,
                                               sequence_parallel=par.sequence_parallel,
                                               init_method=init_normal(mup.hidden_std(cfg)), device=device, dtype=dtype)
        if cfg.qk_layernorm:
            # each TP rank normalises its own heads: the weights' gradients are partial sums over TP (Megatron
            # sums them over TP in finalize_model_grads)
            partial = par.tp_size > 1
            self.q_layernorm = Norm.of(cfg, self.d, partial, device=device, dtype=dtype, kernels=par.kernels)
            self.k_layernorm = Norm.of(cfg, self.d, partial, device=device, dtype=dtype, kernels=par.kernels)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.linear_proj = RowParallelLinear(cfg.num_attention_heads * self.d, cfg.hidden_size, tp_group=par.tp_group,
                                             bias=not cfg.disable_bias_linear, sequence_parallel=par.sequence_parallel,
                                             init_method=output_init(cfg), device=device, dtype=dtype)
        mark_fusable(self.linear_qkv, self.linear_proj)  # weight gradients may go into main_grad directly
        self.core_attention = build_core(cfg, par, layer_index, device, dtype)
        # --kernel-decode-attention fused (auto: on CUDA in bf16 / fp16, where its dots' precision is the model's): a
        # one-row decode step's rotation, cache write and attention in one kernel where q and k reach the core as
        # projected (and, with --qk-layernorm, RMS-normalised: norms applied as stored) and rotated by the plain
        # rotate-half rotation
        switch = par.kernels.kernel_decode_attention
        norms_fuse = self.q_layernorm is None or (self.q_layernorm.plain_rms and self.k_layernorm.plain_rms)
        self.fused_decode = (switch in ("fused", "fused_qkv", "auto") and self.rotate is apply_rotary
                             and not self.gated and norms_fuse
                             and getattr(self.core_attention, "decode", None) is not None)
        self.fused_decode_asked = switch in ("fused", "fused_qkv")  # (off CUDA its torch reference; auto: unfused)
        self.fused_qkv = self.fused_decode and switch == "fused_qkv"  # the QKV row GEMV in the same kernel

    def cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of the keys and of the values an inference KV cache keeps per token (this rank's groups)."""
        return (self.groups, self.d), (self.groups, self.d)

    @property
    def flash(self) -> bool:
        """Whether this layer's core is FlashAttention-4 (the start-up line names it)."""
        return isinstance(self.core_attention, FlashAttention)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        recompute = self.recompute_core and self.training and torch.is_grad_enabled()
        with offload.at(self, "qkv_linear"):  # (--offload-modules: model/activation_offload.py)
            qkv = self.linear_qkv(x, gemv=ctx.gemv)  # [s, b, groups * (q_rows + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups, self.q_rows + 2, self.d)
        if self.decodes_fused(qkv, ctx):
            return self.linear_proj(self.decode_attention(qkv, ctx), residual, ctx.gemv)
        if self.core_attention.fuses_rotary(ctx, s):  # the rotary embedding inside the core's op (flash.py)
            with offload.at(self, "core_attn"):
                out = self.core_attention.attend_rotary(qkv, ctx, recompute)
            return self._project(out, residual, ctx)
        # split, not sliced: its backward writes qkv's gradient once (a slice's and a select's would each write a
        # whole qkv-sized gradient, then added)
        q, gate, k, v = qkv.split([self.q_per_group, self.q_rows - self.q_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.heads, self.d)
        gate = gate.reshape(s, b, self.heads * self.d) if self.gated else None
        k, v = k.squeeze(3), v.squeeze(3)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if ctx.rope is not None and self.rotate is not None:
            q, k = self.rotate(q, *ctx.rope), self.rotate(k, *ctx.rope)
        with offload.at(self, "core_attn"):
            out = self.core_attention.attend(q, k, v, ctx, recompute)  # [s, b, heads * d]
        if gate is not None:
            out = apply_output_gate(out, gate)
        return self._project(out, residual, ctx)

    def decodes_fused(self, qkv: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether this pass (qkv [s, b, ...] as the projection wrote it) takes the fused decode attention."""
        return (self.fused_decode and (self.fused_decode_asked or (qkv.is_cuda and qkv.dtype in HALF))
                and self.core_attention.decodes_rotary(ctx, qkv.size(0), qkv.size(1)))  # (sdpa.py)

    def decode_attention(self, qkv: torch.Tensor, ctx: ForwardContext, pdl: Optional[bool] = None) -> torch.Tensor:
        """The fused decode attention of a one-row step (``decodes_fused``): qkv [1, 1, ...] -> [1, 1, heads * d],
        before the output projection; ``pdl``: launched early (default: --kernel-decode-pdl on)."""
        qkv = qkv.view(1, 1, self.groups, self.q_rows + 2, self.d)
        return self.core_attention.attend_decode_rotary(qkv, ctx, pdl, self._head_norms())

    def _head_norms(self) -> Optional[tuple]:
        """(the query heads' RMSNorm weight, the key heads', eps) of --qk-layernorm for the fused decode kernels."""
        if self.q_layernorm is None:
            return None
        return self.q_layernorm.weight, self.k_layernorm.weight, self.q_layernorm.eps

    def decode_qkv_attention(self, x: torch.Tensor, norm, ctx: ForwardContext,
                             pdl: Optional[bool] = None) -> Optional[torch.Tensor]:
        """--kernel-decode-attention fused_qkv: the one-row step's normed QKV projection of ``x`` (``norm``: the
        layer's RMSNorm before it) and the fused decode attention as one kernel, [1, 1, heads * d]; None where it
        does not take the step (the row GEMV and the fused attention then run as two kernels)."""
        if not self.fused_qkv:
            return None
        return self.core_attention.attend_qkv_rotary(x, self.linear_qkv.weight, self.linear_qkv.bias, norm.weight,
                                                     norm.eps, ctx, pdl, self._head_norms())

    def _project(self, out: torch.Tensor, residual: Optional[torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        with offload.at(self, "attn_proj"):
            return self.linear_proj(out, residual, ctx.gemv)

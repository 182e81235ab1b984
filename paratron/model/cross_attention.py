"""The decoder layer of an encoder-decoder model (T5): self-attention, then cross-attention over the encoder's
output, then the MLP, each pre-norm with its residual (Megatron-core's ``cross_attention`` and
``pre_cross_attn_layernorm``), and the decoder stack of such layers.

Cross-attention is split over tensor-parallel ranks as self-attention is: ``linear_q`` (the decoder's hidden
states) and ``linear_kv`` (the encoder's output; per head its key rows then its value rows, Megatron's layout) are
column-parallel, each rank attending with its heads, ``linear_proj`` row-parallel. Under sequence parallelism
both inputs arrive split along the sequence and the column-parallel layers gather them. It attends with the same
core as self-attention (torch SDPA under the pass's mask: the encoder's padding).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..parallel.linear import mark_fusable
from ..parallel.random import checkpoint, seeded_init
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, init_normal
from . import mup
from .attention.sdpa import SDPAttention
from .context import ForwardContext, Parallel
from .mlp import output_init
from .norms import Norm
from .spec import LayerSpec
from .transformer import TransformerLayer


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values from the encoder's output ``memory`` [s_enc(/TP), b, h]."""

    takes_residual = True  # forward(x, memory, ctx, residual): linear_proj adds it

    def __init__(self, cfg: ModelConfig, par: Parallel, device=None, dtype=None, layer_index: int = 0):
        super().__init__()
        self.par, self.d, self.layer_index = par, cfg.kv_channels, layer_index
        self.heads = cfg.num_attention_heads // par.tp_size
        width, bias = cfg.num_attention_heads * cfg.kv_channels, not cfg.disable_bias_linear
        init, sp = init_normal(mup.hidden_std(cfg)), par.sequence_parallel
        self.linear_q = ColumnParallelLinear(cfg.hidden_size, width, tp_group=par.tp_group, bias=bias,
                                             sequence_parallel=sp, init_method=init, device=device, dtype=dtype)
        self.linear_kv = ColumnParallelLinear(cfg.hidden_size, 2 * width, tp_group=par.tp_group, bias=bias,
                                              sequence_parallel=sp, init_method=init, device=device, dtype=dtype)
        self.linear_proj = RowParallelLinear(width, cfg.hidden_size, tp_group=par.tp_group, bias=bias,
                                             sequence_parallel=sp, init_method=output_init(cfg), device=device,
                                             dtype=dtype)
        mark_fusable(self.linear_q, self.linear_kv, self.linear_proj)
        self.core_attention = SDPAttention(cfg, par, layer_index, device, dtype)
        self.recompute_core = False  # --recompute-granularity selective

    def keys_values(self, memory: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder output's keys and values [s_enc, b, heads/TP, d]; without autograd (generation) made once
        per context and kept in its memo for the next decoding steps."""
        key = ("cross_kv", self.layer_index)
        if not torch.is_grad_enabled() and key in ctx.memo:
            return ctx.memo[key]
        kv = self.linear_kv(memory)
        s, b = kv.shape[:2]
        kv = kv.view(s, b, self.heads, 2, self.d)
        out = kv.unbind(3)  # (its backward writes kv's gradient once; two selects' would each write a whole one)
        if not torch.is_grad_enabled():
            ctx.memo[key] = out
        return out

    def forward(self, x: torch.Tensor, memory: torch.Tensor, ctx: ForwardContext,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        q = self.linear_q(x)
        s, b = q.shape[:2]
        k, v = self.keys_values(memory, ctx)
        recompute = self.recompute_core and self.training and torch.is_grad_enabled()
        out = self.core_attention.attend(q.view(s, b, self.heads, self.d), k, v, ctx, recompute)
        return self.linear_proj(out, residual)


class DecoderLayer(TransformerLayer):
    """A transformer layer with cross-attention between self-attention and the MLP."""

    def __init__(self, cfg: ModelConfig, par: Parallel, spec: LayerSpec, device=None, dtype=None):
        super().__init__(cfg, par, spec, device, dtype)
        self.pre_cross_attn_layernorm = Norm.of(cfg, cfg.hidden_size, par.sequence_parallel, device, dtype,
                                                par.kernels)
        self.cross_attention = CrossAttention(cfg, par, device, dtype, layer_index=spec.index)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, memory: torch.Tensor,
                cross: ForwardContext) -> torch.Tensor:
        x = self._mix(self.input_layernorm, self.self_attention, x, ctx)
        x = self._mix(self.pre_cross_attn_layernorm, self.cross_attention, x, memory, cross)
        return self._feed(x)


class DecoderStack(nn.Module):
    """``num_layers`` decoder layers and the final norm. ``recompute_granularity`` full: every layer's activations
    recomputed in backward; selective: the attention cores'."""

    def __init__(self, cfg: ModelConfig, par: Parallel, num_layers: int, recompute_granularity: Optional[str] = None,
                 device=None, dtype=None, seed: Optional[int] = None):
        super().__init__()
        self.par, self.recompute = par, recompute_granularity
        self.layer_offset = 0  # (the checkpoint's names: T5 is never split over pipeline stages)
        layers = []
        for i in range(num_layers):
            with seeded_init(seed, f"decoder.layer{i}", device) if seed is not None else contextlib.nullcontext():
                layers.append(DecoderLayer(cfg, par, LayerSpec(i), device, dtype))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = Norm.of(cfg, cfg.hidden_size, par.sequence_parallel, device, dtype, par.kernels)
        for layer in self.layers:
            selective = recompute_granularity == "selective"
            layer.self_attention.recompute_core = layer.cross_attention.recompute_core = selective

    def forward(self, x: torch.Tensor, ctx: ForwardContext, memory: torch.Tensor,
                cross: ForwardContext) -> torch.Tensor:
        full = self.recompute == "full" and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if full:
                x = checkpoint(layer, x, ctx, memory, cross, rng=self.par.trackers())
            else:
                x = layer(x, ctx, memory, cross)
        return self.final_layernorm(x)

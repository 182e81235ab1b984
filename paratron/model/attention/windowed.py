"""The window / sink core: Megatron's attention variants on top of torch SDPA, sliding windows and attention sinks.

* ``--window-size LEFT,RIGHT``: query ``i`` attends to keys ``i - LEFT .. i + RIGHT`` (-1: unbounded;
  attention stays causal, so RIGHT is 0 in effect), as Transformer Engine / flash-attention count
  it: ``127,0`` is a window of 128 tokens (Hugging Face's ``sliding_window=128``).
  ``--window-attn-skip-freq`` says which layers keep full attention (:func:`window_layers`).
* ``--softmax-type off-by-one | learnable``: a sink logit per query head joins every softmax
  denominator (0 for off-by-one, a parameter ``core_attention.softmax_offset`` for learnable,
  gpt-oss's "sinks"); its probability mass attends to nothing.

Both run inside SDPA (no [s, s] float mask, no softmax outside the kernel):

* the window is a mask built once per forward pass (``ForwardContext.memo``, additive, in the
  activations' dtype, as SDPA would convert a boolean one in every layer) and shared by every
  windowed layer: the causal/document mask of the pass and-ed with the band;
* the sink is one extra key whose value is zero (``parallel.context.with_sink_dims``). Keys get
  ``PAD`` extra zero dimensions, the sink key has a 1 in the first, and each query head carries
  ``sink / scale`` there, so its score with the sink key is exactly its sink logit (grouped-query
  heads share keys, so the per-head value must sit on the query side). Without a window or mask, a
  dummy first query lets the sink key lead the sequence with ``is_causal`` (the flash kernel's path
  on CUDA); otherwise the mask gains an always-open column.

On CUDA, flash attention takes no mask and the memory-efficient kernel (which does) takes no grouped
heads, so a masked layer repeats the keys and values to every query head first; the unmasked causal
path keeps them grouped (flash).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import mup
from ...config.layer_patterns import layer_pattern, parse_window_size, rope_layers, window_layers  # noqa: F401
from ...config.values import SOFTMAX_TYPES  # noqa: F401
from ...parallel.sharding import ShardSpec, Split, set_spec, shard
from ...parallel import comm
from ...parallel.context import with_sink_dims
from .sdpa import SDPAttention


def needs_core_attention(cfg) -> bool:
    return parse_window_size(cfg.window_size) is not None or cfg.softmax_type != "vanilla"


class WindowedAttention(SDPAttention):
    """SDPA with the window of layer ``index`` (when it has one) and the softmax variant: the core of every layer
    of a model with --window-size or --softmax-type other than vanilla (``needs_core_attention``)."""

    decodes = False  # one-token steps over the KV cache run this core too

    def __init__(self, cfg, par, index: int = 0, device=None, dtype=None):
        super().__init__(cfg, par, index, device, dtype)
        window = parse_window_size(cfg.window_size)
        uses = window_layers(cfg.window_size, cfg.window_attn_skip_freq, cfg.num_layers)[index]
        self.window = window if uses and window[0] != -1 else None  # unbounded left: causal attention itself
        self.softmax_type = cfg.softmax_type
        self.softmax_scale = mup.softmax_scale(cfg, cfg.kv_channels) or 1.0 / math.sqrt(cfg.kv_channels)
        heads = cfg.num_attention_heads
        if cfg.softmax_type == "learnable":
            full = torch.empty(heads, device=device, dtype=dtype)
            nn.init.normal_(full, mean=0.0, std=mup.hidden_std(cfg))  # Megatron: config.init_method
            spec = ShardSpec(splits=(Split(0, "tp", (heads,)),))
            tp = (comm.group_rank(par.tp_group), comm.group_size(par.tp_group))
            self.softmax_offset = set_spec(nn.Parameter(shard(full, spec, {"tp": tp})), spec)
        elif cfg.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads // par.tp_size, device=device, dtype=dtype),
                                 persistent=False)
        else:
            self.softmax_offset = None

    def extra_repr(self) -> str:
        return f"window={self.window}, softmax_type={self.softmax_type}"

    def paged_options(self) -> dict:
        """The paged engine's attention (kernels/paged_attention.py): this layer's window and sink logits."""
        return {"window": None if self.window is None else self.window[0], "sinks": self.softmax_offset}

    def forward(self, q, k, v, ctx, dropout_p: float = 0.0) -> torch.Tensor:
        """q [b, heads, sq, d], k/v [b, groups, sk, d] -> [b, heads, sq, d]."""
        allowed = self._allowed(q, k, ctx)
        gqa, d, sink, scale = q.size(1) != k.size(1), q.size(-1), self.softmax_offset, self.softmax_scale
        if allowed is None and sink is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
        if sink is not None:
            q, k, v = with_sink_dims(q, k, v, sink, scale)
        if allowed is None:  # causal, square: a dummy first query lets the sink key lead under is_causal
            q = torch.cat([q.new_zeros(q.shape[:2] + (1, q.size(-1))), q], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
            return out[:, :, 1:, :d]
        if gqa and q.is_cuda:  # SDPA's masked CUDA kernel (memory-efficient) takes no grouped heads
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._additive(allowed, ctx, q.dtype, sink is not None),
                                             dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        return out[..., :d]

    def _additive(self, allowed, ctx, dtype, sink: bool) -> torch.Tensor:
        """``allowed`` as the additive mask SDPA would make of it (0 / -inf, with the sink's open column
        first), once per forward pass: SDPA would otherwise convert a boolean mask in every layer."""
        key = ("additive", self.window, tuple(allowed.shape), dtype, sink)
        if key not in ctx.memo:
            if sink:
                allowed = torch.cat([allowed.new_ones(allowed.shape[:-1] + (1,)), allowed], dim=-1)
            # rows padded to a multiple of 16 (the slice is what SDPA sees): its CUDA kernel would
            # otherwise copy an unaligned mask into an aligned one at every call
            width = -(-allowed.size(-1) // 16) * 16
            mask = torch.zeros(allowed.shape[:-1] + (width,), dtype=dtype, device=allowed.device)
            mask = mask[..., :allowed.size(-1)]
            ctx.memo[key] = mask.masked_fill_(~allowed, float("-inf"))
        return ctx.memo[key]

    def _allowed(self, q, k, ctx) -> Optional[torch.Tensor]:
        """Boolean [b or 1, 1, sq, sk] (True = attend) of this layer, or None for plain causal attention
        over a square score matrix."""
        sq, sk = q.size(2), k.size(2)
        if self.window is None:
            if ctx.mask is not None:
                return ctx.mask
            if ctx.causal and sq == sk and ctx.kv_cache is None:
                return None
            return _base(q, k, ctx)
        key = ("window", self.window, sq, sk)
        if key not in ctx.memo:  # once per forward pass, shared by every windowed layer
            q_at, k_at = _positions(q, k, ctx)
            left, right = self.window
            band = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
            if left >= 0:
                band &= k_at[None, :] >= q_at[:, None] - left
            if right >= 0:
                band &= k_at[None, :] <= q_at[:, None] + right
            ctx.memo[key] = band & _base(q, k, ctx)
        return ctx.memo[key]


def _positions(q, k, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence indices of the queries and keys (cache slots at inference: consecutive per row)."""
    sq, sk = q.size(2), k.size(2)
    k_at = torch.arange(sk, device=q.device)
    if ctx.kv_cache is not None:
        return ctx.kv_cache.slots.to(q.device), k_at
    return torch.arange(sq, device=q.device) + (sk - sq), k_at


def _base(q, k, ctx) -> torch.Tensor:
    """The pass's own pattern as a boolean mask: its mask, or causality."""
    if ctx.mask is not None:
        return ctx.mask
    q_at, k_at = _positions(q, k, ctx)
    if not ctx.causal:
        return torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device)
    return k_at[None, :] <= q_at[:, None]


CoreAttention = WindowedAttention  # its name before the attention package (tests, benchmarks)

"""The plain attention core, torch SDPA, and the frame every core shares.

A core is chosen when the layer is built (``self_attention.build_core``) and registered as the layer's
``core_attention`` (Megatron's name). It takes the layer's queries, keys and values sequence-first and returns
the attention output ready for the output projection:

* ``attend(q, k, v, ctx, recompute)``: q [s, b, heads, d], k / v [s, b, groups, d] -> [s, b, heads * d]. The
  frame: heads-first layout, the inference KV cache (this pass's keys and values stored, attention over what the
  cache holds, one-token steps through the decode core, decode.py), activation recomputation of ``core``.
* ``core(q, k, v, ctx)``: over [b, heads, s, d], the part ``--recompute-modules core_attn`` recomputes:
  ``forward`` with this layer's dropout under the tensor-parallel RNG stream.
* ``forward(q, k, v, ctx, dropout_p)``: the attention itself over [b, heads, s, d] (Megatron's core attention).
* ``fuses_rotary`` / ``attend_rotary``: FlashAttention-4 with the rotary embedding inside the op (flash.py);
  never here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...config.kernels import asked_on
from .. import mup
from ...kernels import decode_qkv_attention, decode_rotary
from ...parallel.random import checkpoint
from .decode import GroupedDecode


class SDPAttention(nn.Module):
    """torch SDPA with grouped query heads, causal or under the pass's mask."""

    decodes = True  # one-token steps with grouped heads take the decode core (the window / sink core does not)
    context_parallel = False  # whether it attends across context-parallel ranks (context_parallel.py)

    def __init__(self, cfg, par, layer_index: int = 0, device=None, dtype=None):
        super().__init__()
        self.par, self.layer_index = par, layer_index  # the global layer number (its slot in an inference KV cache)
        self.d = cfg.kv_channels
        self.heads = cfg.num_attention_heads // par.tp_size
        self.groups = cfg.num_query_groups // par.tp_size
        self.dropout = cfg.attention_dropout
        self.scale = mup.softmax_scale(cfg, self.d)  # the scores' scale: None is the kernels' 1/sqrt(d)
        self.decode = self._grouped_decode(par) if self.decodes else None
        self.decode_pdl = asked_on(par.kernels.kernel_decode_pdl)  # its launch (auto: the layer's row path decides)

    def _grouped_decode(self, par) -> Optional[GroupedDecode]:
        """The decode core of one-token steps with grouped heads (None: plain heads, the frame's core)."""
        if self.groups == self.heads:
            return None
        return GroupedDecode(self.heads, self.groups, self.d, self.scale, par.kernels.kernel_decode_attention)

    def attend(self, q, k, v, ctx, recompute: bool = False) -> torch.Tensor:
        """q [s, b, heads, d], k / v [s, b, groups, d] -> [s, b, heads * d]; ``recompute``: ``core`` again in
        backward (--recompute-activations)."""
        if ctx.cp is not None and not self.context_parallel:
            raise ValueError(f"{type(self).__name__}: a context-parallel pass reached a layer built without "
                             "context parallelism (build the model with the ParallelDims it runs under)")
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if getattr(ctx.kv_cache, "paged", False):  # the paged engine's step: the view stores and attends
            out = ctx.kv_cache.attend(self.layer_index, q, k, v, self.scale, **self.paged_options())  # paged_cache.py
            return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.d)
        if ctx.kv_cache is not None:  # inference: store this pass's keys/values, attend over the cache
            k, v = ctx.kv_cache.update(self.layer_index, k, v)
        if ctx.kv_cache is not None and s == 1 and self.decode is not None:
            out = self.decode(q, k, v, ctx)
        elif recompute:
            out = checkpoint(self.core, q, k, v, ctx, rng=self.par.rng)
        else:
            out = self.core(q, k, v, ctx)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.d)

    def paged_options(self) -> dict:
        """What the paged cache's attention needs beyond causality (windowed.py: the window and the sinks)."""
        return {}

    def core(self, q, k, v, ctx) -> torch.Tensor:
        """[b, heads, s, d] -> [b, heads, s, d] with this layer's dropout (on the TP rank's RNG stream)."""
        p = self.dropout if self.training else 0.0
        with self.par.fork():
            return self(q, k, v, ctx, p)

    def forward(self, q, k, v, ctx, dropout_p: float = 0.0) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, dropout_p=dropout_p, is_causal=ctx.causal,
                                              enable_gqa=self.groups != self.heads, scale=self.scale)

    def fuses_rotary(self, ctx, s: int) -> bool:
        """Whether ``attend_rotary`` takes this pass (the rotary embedding inside the attention op): flash.py."""
        return False

    def decodes_rotary(self, ctx, s: int, b: int) -> bool:
        """Whether ``attend_decode_rotary`` can take this pass (the layer asked for it: --kernel-decode-attention
        fused): one token of one row over the fixed-batch engine's cache (not the paged engine's, not a row joining
        a running batch), with one cos / sin over the whole head."""
        cache = ctx.kv_cache
        if s != 1 or b != 1 or cache is None or getattr(cache, "paged", False) or ctx.rope is None:
            return False
        cos, sin = ctx.rope
        return cos.shape == sin.shape == (1, 1, 1, self.d) and cache.bounds() is not None

    def attend_decode_rotary(self, qkv, ctx, pdl: Optional[bool] = None, norms: Optional[tuple] = None) -> torch.Tensor:
        """qkv [1, 1, groups, q_per_group + 2, d] of a one-row decode step -> [1, 1, heads * d]: the rotary
        embedding of its query heads and key, its key and value into the cache, attention over the cache, in one
        kernel (kernels/decode_rotary.py); ``pdl``: launched early (programmatic dependent launch; default:
        --kernel-decode-pdl on); ``norms``: (the query heads' RMSNorm weight, the key heads', eps) of
        --qk-layernorm, applied before the rotation."""
        k_cache, v_cache = ctx.kv_cache.buffers(self.layer_index)
        pad, slot = ctx.kv_cache.bounds()
        scale = self.scale if self.scale is not None else self.d ** -0.5
        out = decode_rotary.decode_rotary_attention(qkv, *ctx.rope, k_cache, v_cache, pad, slot, scale,
                                                    counts=ctx.kv_cache.counts(),
                                                    pdl=self.decode_pdl if pdl is None else pdl, norms=norms)
        return out.reshape(1, 1, self.heads * self.d)

    def attend_qkv_rotary(self, x, weight, bias, norm_weight, eps: float, ctx, pdl: Optional[bool] = None,
                          norms: Optional[tuple] = None) -> Optional[torch.Tensor]:
        """The QKV projection of the one-row ``x`` (after the RMSNorm ``norm_weight``, ``eps``; the projection's
        ``weight`` and ``bias``) and :meth:`attend_decode_rotary` as one kernel (kernels/decode_qkv_attention.py),
        [1, 1, heads * d]; None on CUDA where the kernel does not take the step (off CUDA its torch reference)."""
        k_cache, v_cache = ctx.kv_cache.buffers(self.layer_index)
        pad, slot = ctx.kv_cache.bounds()
        scale = self.scale if self.scale is not None else self.d ** -0.5
        out = decode_qkv_attention.decode_qkv_attention(
            x, weight, norm_weight, eps, bias, *ctx.rope, k_cache, v_cache, pad, slot, scale, ctx.kv_cache.counts(),
            self.groups, self.decode_pdl if pdl is None else pdl, norms)
        return None if out is None else out.reshape(1, 1, self.heads * self.d)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, groups={self.groups}, d={self.d}"

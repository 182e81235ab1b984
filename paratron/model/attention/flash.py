"""The FlashAttention-4 core (Hopper, bf16; kernels/flash_attention.py), as ``--attention-backend`` says: auto /
fused (cuDNN's forward where it runs, FlashAttention-4's backward), flash (FlashAttention-4's forward too).

It takes plain causal attention over the whole sequence in training, on the sequence-first activations without
transposes; every other forward (a mask, dropout, no autograd, ``--deterministic-mode``, the KV cache) runs the
SDPA core it extends. With the layer's plain rotate-half rotation it also takes the rotary embedding inside the op
(``attend_rotary``), unless ``--no-rope-fusion``.
"""
from __future__ import annotations

import torch

from ...kernels import flash_attention
from ...kernels.rotary import apply_rotary
from ...parallel.random import checkpoint
from .sdpa import SDPAttention


class FlashAttention(SDPAttention):
    """FlashAttention-4 where the forward allows it, else SDPA. ``rotation``: the layer's rotary function (None:
    a NoPE layer); ``fusable``: whether the layer's q and k reach the core as projected (no q / k layernorm, no
    output gate), so the rotary embedding may run inside the op."""

    def __init__(self, cfg, par, layer_index: int = 0, device=None, dtype=None, rotation=None, fusable=False):
        super().__init__(cfg, par, layer_index, device, dtype)
        k = par.kernels
        self.q_per_group = cfg.num_attention_heads // cfg.num_query_groups
        self.cudnn_fwd = k.attention_backend != "flash"
        self.packed_bwd = k.kernel_packed_gqa_backward != "off"  # experimental (kernels/experimental)
        self.fused_rope = not k.no_rope_fusion and rotation is apply_rotary and fusable

    def applies(self, ctx) -> bool:
        """Plain causal attention over the whole sequence, with autograd, without dropout, not under
        --deterministic-mode (kernels/flash_attention.py says why)."""
        return (ctx.cp is None and ctx.mask is None and ctx.causal and ctx.kv_cache is None
                and torch.is_grad_enabled() and not (self.training and self.dropout > 0)
                and not torch.are_deterministic_algorithms_enabled())

    def attend(self, q, k, v, ctx, recompute: bool = False) -> torch.Tensor:
        if not self.applies(ctx):
            return super().attend(q, k, v, ctx, recompute)
        if recompute:
            return checkpoint(flash_attention.causal_attention, q, k, v, self.scale, self.cudnn_fwd, rng=self.par.rng)
        return flash_attention.causal_attention(q, k, v, self.scale, self.cudnn_fwd)

    def fuses_rotary(self, ctx, s: int) -> bool:
        """The rotary embedding inside the op (flash_attention.rotary_causal_attention, kernels/rotary.py): the
        plain rotate-half rotation over the whole head with one cos / sin per position ([s, 1, 1, d]: no
        position_ids), on a forward this core takes."""
        if not (self.fused_rope and ctx.rope is not None):
            return False
        cos, sin = ctx.rope
        return (cos.shape == sin.shape == (s, 1, 1, self.d) and not (cos.requires_grad or sin.requires_grad)
                and self.applies(ctx))

    def attend_rotary(self, qkv, ctx, recompute: bool = False) -> torch.Tensor:
        """qkv [s, b, groups, q_per_group + 2, d] -> [s, b, heads * d]: the rotary embedding of q and k and
        FlashAttention-4 in one op (under core recompute both are recomputed; qkv and cos / sin are kept)."""
        args = (qkv, *ctx.rope, self.scale, self.q_per_group, self.cudnn_fwd, self.packed_bwd)
        if recompute:
            return checkpoint(flash_attention.rotary_causal_attention, *args, rng=self.par.rng)
        return flash_attention.rotary_causal_attention(*args)

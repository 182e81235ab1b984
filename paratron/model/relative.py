"""T5's relative position buckets (``--position-embedding-type relative``): one learned scalar per head and bucket
of key-minus-query distance, added to the attention scores.

Buckets (``--relative-attention-num-buckets`` n, ``--relative-attention-max-distance`` m): bidirectional (the
encoder) gives half the buckets to keys after the query; within each half the first n/4 (n/2 one-way) distances
have a bucket each, the rest share buckets spaced logarithmically up to m, beyond which all distances share the
last bucket. The decoder is one-way: keys after the query do not exist for it.

The table (Megatron's ``encoder_relative_pos_emb.relative_attention_bias.weight``, [buckets, heads]) lives on every
tensor-parallel rank; the bias of all heads is computed once per forward and each rank takes its heads (their
gradients gathered back, so every rank's table gets the whole gradient, as Megatron's scatter).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel import comm


def relative_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """The bucket of each ``relative`` = key position - query position (an integer tensor)."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    # distances past ``exact``: log-spaced buckets up to max_distance (distance 0 is exact, so log(0) is never used)
    scaled = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (scaled * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """[buckets, heads] table -> the bias [1, heads/TP, q, k] of this rank's heads for ``q`` queries at positions
    ``offset`` .. ``offset + q - 1`` over ``k`` keys at 0 .. k - 1."""

    def __init__(self, num_buckets: int, max_distance: int, heads: int, bidirectional: bool, tp_group=None,
                 init_method=None, device=None, dtype=None):
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.tp_group = tp_group
        self.relative_attention_bias = nn.Embedding(num_buckets, heads, device=device, dtype=dtype)
        if init_method is not None:
            init_method(self.relative_attention_bias.weight.data)

    def forward(self, q: int, k: int, offset: int = 0) -> torch.Tensor:
        device = self.relative_attention_bias.weight.device
        query = torch.arange(offset, offset + q, device=device)[:, None]
        key = torch.arange(k, device=device)[None, :]
        buckets = relative_bucket(key - query, self.bidirectional, self.num_buckets, self.max_distance)
        bias = self.relative_attention_bias(buckets)  # [q, k, heads]
        bias = comm.scatter_to_tp(bias, self.tp_group)  # [q, k, heads/TP]: this rank's heads
        return bias.permute(2, 0, 1).unsqueeze(0)

    def extra_repr(self) -> str:
        return f"buckets={self.num_buckets}, max_distance={self.max_distance}, bidirectional={self.bidirectional}"

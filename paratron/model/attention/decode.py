"""The decode core: one new token per row with grouped keys and values (the inference engine's decode steps over
the KV cache, ``SDPAttention.attend``). Each group's query heads attend as one sequence of ``q_per_group``
queries, so the cached keys and values are read once, never repeated per head. ``--kernel-decode-attention``
chooses how: auto / triton: matmuls around one fused softmax for a single row, the Triton kernel
(kernels/decode_attention.py) for more rows on CUDA; sdpa: torch SDPA on the grouped queries."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...kernels import decode_attention

SMALL_DECODE_BATCH = 1  # decode attention as matmuls up to this batch size


class GroupedDecode:
    """q [b, heads, 1, d], the cache's k / v [b, groups, T, d] -> [b, heads, 1, d], under the pass's mask."""

    def __init__(self, heads: int, groups: int, d: int, scale: Optional[float], kernel: str = "auto"):
        self.heads, self.groups, self.d = heads, groups, d
        self.q_per_group = heads // groups
        self.scale = scale  # None: 1/sqrt(d)
        self.kernel = kernel  # auto / triton: the kernels above; sdpa

    def __call__(self, q, k, v, ctx) -> torch.Tensor:
        b = q.size(0)
        grouped = q.reshape(b, self.groups, self.q_per_group, self.d)
        scale = self.scale if self.scale is not None else self.d ** -0.5
        if b <= SMALL_DECODE_BATCH and self.kernel != "sdpa":
            # one row: scores and values as matmuls around one fused softmax kernel (SDPA's fused kernel
            # has a block per row and head group only). More rows: the Triton kernel (kernels/decode_attention.py;
            # faster than SDPA's at batch 32: benchmarks/results/decode_bench_llama-1b_20261126_045119.md)
            out = decode_attention.masked_attention(grouped, k, v, ctx.mask, scale)
            return out.reshape(b, self.heads, 1, self.d)
        bounds = ctx.kv_cache.bounds()
        if (bounds is not None and q.is_cuda and self.kernel != "sdpa"
                and decode_attention.supported(grouped, k, v)):
            out = decode_attention.decode_attention(grouped, k, v, *bounds, scale)  # one Triton kernel
        else:
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=ctx.mask, scale=self.scale)  # mask [b,1,1,T]
        return out.reshape(b, self.heads, 1, self.d)

"""Attention of one new token per row over the KV cache (decoding), as one Triton kernel.

Grouped-query decoding attends ``q_per_group`` query heads of each key/value group of each row over
that group's cached keys: q ``[b, groups, q_per_group, d]`` against k, v ``[b, groups, capacity, d]``.
The keys a row may see are its real slots up to the current one: ``pad[row] <= t <= slot`` (the cache
is left-padded; ``paratron/inference/cache.py``). SDPA's fused kernel, given that as a mask, runs one
block of 64 query rows per (row, group) for 4 real queries over the whole capacity. This kernel runs one
program per (row, group), computes the mask from ``pad`` and ``slot`` itself and stops at ``slot``: the cache
beyond it is never read. ``slot``
and ``pad`` are read from device memory, so a captured CUDA graph replays it for every step.

On CPUs, or without Triton, :func:`decode_attention` is the torch expression
(:func:`decode_attention_reference`), which is also what the tests compare the kernel with (on CPU
through Triton's interpreter).
"""
from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_T = 64  # cached keys per loop iteration


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale where ``allowed``) v as two matmuls around an fp32 softmax (the
    probabilities in v's dtype): the batch-1 decode path, and with fp32 inputs the reference."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(probs, v)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor,
                               slot: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, over the slots pad[row] <= t <= slot) v, in fp32, in q's dtype."""
    t = torch.arange(k.size(2), device=k.device)
    allowed = ((t[None, :] >= pad[:, None]) & (t[None, :] <= slot))[:, None, None, :]  # [b, 1, 1, T]
    return masked_attention(q.float(), k.float(), v.float(), allowed, scale).to(q.dtype)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel's shapes: a power-of-two head dim of 16..256, at most 128 queries per group, keys and
    values contiguous along the head dim (the cache's layout)."""
    d = q.size(-1)
    return (triton is not None and 16 <= d <= 256 and d & (d - 1) == 0 and q.size(2) <= 128
            and k.stride(-1) == 1 and v.stride(-1) == 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, slot: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``[b, groups, q_per_group, d]``: each row's queries over its cached slots ``pad[row] .. slot``."""
    if q.is_cuda and supported(q, k, v):
        return torch.ops.paratron.decode_attention(q.contiguous(), k, v, pad, slot, scale)
    return decode_attention_reference(q, k, v, pad, slot, scale)


if triton is not None:
    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, pad_ptr, slot_ptr, out_ptr, groups, scale,
                       sqb, sqg, sqh, skb, skg, skt, svb, svg, svt, sob, sog, soh,
                       QPG: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
        pid = tl.program_id(0)
        b, g = pid // groups, pid % groups
        rows, cols = tl.arange(0, QB), tl.arange(0, D)
        # fp32 operands (tl.dot then runs in tf32, exact for bf16 inputs; the step is bound by reading the cache)
        q = tl.load(q_ptr + b * sqb + g * sqg + rows[:, None] * sqh + cols[None, :], mask=rows[:, None] < QPG,
                    other=0.0).to(tl.float32)
        first = tl.load(pad_ptr + b)
        end = tl.load(slot_ptr) + 1  # the slots this step attends over: [first, end)
        m = tl.full([QB], float("-inf"), tl.float32)
        total = tl.zeros([QB], tl.float32)
        acc = tl.zeros([QB, D], tl.float32)
        k_base, v_base = k_ptr + b * skb + g * skg, v_ptr + b * svb + g * svg
        for start in range(0, end, BT):
            t = start + tl.arange(0, BT)
            ok = (t >= first) & (t < end)
            keys = tl.load(k_base + t[:, None] * skt + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(keys)) * scale  # [QB, BT] fp32
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no allowed slot adds nothing
            alpha = tl.exp(m - safe)
            p = tl.exp(s - safe[:, None])
            total = total * alpha + tl.sum(p, 1)
            vals = tl.load(v_base + t[:, None] * svt + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, vals)
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + b * sob + g * sog + rows[:, None] * soh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < QPG)

    @torch.library.custom_op("paratron::decode_attention", mutates_args=())
    def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, slot: torch.Tensor,
                   scale: float) -> torch.Tensor:
        b, groups, qpg, d = q.shape
        out = torch.empty_like(q)
        if out.numel():
            with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
                _decode_kernel[(b * groups,)](
                    q, k, v, pad, slot, out, groups, scale, q.stride(0), q.stride(1), q.stride(2),
                    k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                    out.stride(0), out.stride(1), out.stride(2),
                    QPG=qpg, QB=max(16, triton.next_power_of_2(qpg)), D=d, BT=BLOCK_T)
        return out

    @_decode_op.register_fake
    def _(q, k, v, pad, slot, scale):
        return torch.empty_like(q)

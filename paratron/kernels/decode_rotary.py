"""One batch-1 decode step of grouped-query attention as one Triton kernel: the rotary embedding of the new token's
query heads and key, its key and value written into the KV cache, and attention over the cache.

Unfused, a decode step at batch 1 spends about six kernels a layer here (the query and key rotations and the two
cache writes, which Inductor fuses into three, then two matmuls around a softmax over the whole cache:
``model/attention/decode.py``), each a few microseconds of launch and ramp for a few kilobytes of work. This
kernel reads the layer's QKV projection output as the GEMV wrote it (``[groups, q_per_group + 2, d]``: per group
its query heads, its key, its value), rotates the queries and the key in registers with the same rounding as the
model's ``apply_rotary`` (cos and sin in the activations' dtype, each product rounded to it, then the sum), writes
the rotated key and the value at the step's slot, and attends over the cached slots ``pad .. slot - 1`` and the new
token itself (kept in registers: the slot is not read back). One program per key/value group and split of the
cached slots: each split writes its partial softmax (max, denominator, unnormalised sum), counts itself in with an
atomic add on its group's counter (held by the KV cache), and the group's last split to arrive combines the
partials and writes the output, so the splits cost no second launch (``fused_splits``: splits of at most 384
cached slots). Without counters the splits follow the paged engine's rule (``paged_attention.decode_splits``) and
its combine kernel. The slot and the padding are read from device memory, so a captured CUDA graph replays it.

``--kernel-decode-attention fused`` takes it for one-token passes of one row whose layer has the plain rotate-half
rotation over the whole head, no query / key norm and no output gate (``model/attention/self_attention.py``);
:func:`decode_rotary_reference` is the same in torch (what runs off CUDA, and what the tests compare the kernel
with, on CPU through Triton's interpreter).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from .decode_attention import decode_attention_reference
from .hardware import early_launch
from .paged_attention import SPLIT_TARGET, _sms, decode_splits
from .rotary import apply_rotary

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_T = 64  # cached keys per loop iteration
FUSED_SPAN = 6 * BLOCK_T  # cached slots per split when the kernel combines its splits itself
EARLY_T = 256  # cached slots a split launched early (PDL) requests before its wait


def fused_splits(groups: int, capacity: int, sms: int) -> int:
    """Programs per group when the splits combine in the kernel (no second launch to pay for): enough that each
    walks at most ``FUSED_SPAN`` slots of a full cache, no more than ``SPLIT_TARGET`` programs per multiprocessor in
    all. The walk is a chain of dependent loads (its length is the kernel's latency), the combine a few more round
    trips through memory: on an H100 a 384-slot cache was fastest unsplit, a 2,048-slot one with 6 splits
    (benchmarks/results/decode_attention_splits_h100_20261206.md)."""
    return max(1, min(-(-capacity // FUSED_SPAN), SPLIT_TARGET * sms // max(groups, 1)))


def decode_rotary_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, pad: torch.Tensor, slot: torch.Tensor, scale: float,
                            norms: Optional[tuple] = None) -> torch.Tensor:
    """qkv [groups, q_per_group + 2, d] of the new token, cos / sin [d] at its position, the caches [1, groups,
    capacity, d] (written at ``slot``, a 0-d tensor), ``pad`` [1]: the attention output [1, groups, q_per_group, d]
    over the slots pad .. slot, in fp32, in qkv's dtype. ``norms``: (the query heads' RMSNorm weight [d], the key's,
    eps): each head normalised before its rotation, as the model's ``--qk-layernorm`` (``model/norms.py``)."""
    qpg = qkv.size(1) - 2
    q, k = qkv[:, :qpg], qkv[:, qpg]
    if norms is not None:
        q, k = (w * F.rms_norm(x.float(), (x.size(-1),), eps=norms[2]).to(x.dtype) for x, w in zip((q, k), norms))
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    at = slot.reshape(1)
    k_cache.index_copy_(2, at, k[None, :, None].to(k_cache.dtype))
    v_cache.index_copy_(2, at, qkv[None, :, qpg + 1, None].to(v_cache.dtype))
    return decode_attention_reference(q[None], k_cache, v_cache, pad, slot, scale)


def supported(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernel's shapes: one row, a power-of-two head dim of 16..256 (the rotation pairs its halves), at most
    128 query heads per group, the caches in qkv's dtype and contiguous along the head dim."""
    return shapes_supported(qkv.dtype, qkv.size(1) - 2, k_cache, v_cache) and qkv.size(-1) == k_cache.size(-1)


def shapes_supported(dtype: torch.dtype, q_per_group: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """:func:`supported` from the projection's dtype and query heads per group (the head dim is the caches')."""
    d = k_cache.size(-1)
    return (triton is not None and k_cache.size(0) == 1 and 16 <= d <= 256 and d & (d - 1) == 0
            and q_per_group <= 128 and k_cache.dtype == v_cache.dtype == dtype
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def decode_rotary_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, pad: torch.Tensor, slot: torch.Tensor, scale: float,
                            splits: int = 0, counts: Optional[torch.Tensor] = None, pdl: bool = False,
                            norms: Optional[tuple] = None, early: Optional[int] = None) -> torch.Tensor:
    """As :func:`decode_rotary_reference` (``qkv`` any [..., groups, q_per_group + 2, d] of one token), the kernel on
    CUDA where it applies; ``splits``: programs per group (0: :func:`fused_splits`'s choice with ``counts``, else
    ``decode_splits``'s). ``counts``: int32 zeros, at least one per group, kept between calls (the KV cache's: the
    kernel leaves them 0): the splits' partials are then combined by the group's last split to finish, in the same
    kernel, rather than by a second kernel. ``pdl``: launched for programmatic dependent launch (Hopper: the kernel
    starts while the one before it finishes and waits for it before reading anything). ``norms``: the query and key
    heads' RMSNorm (``decode_rotary_reference``). ``early``: cached slots each split loads at its start, before its
    wait when launched early (None: ``EARLY_T`` with ``pdl``, else none): the cache of earlier steps does not depend
    on the kernel before, so under PDL its loads overlap that kernel's tail."""
    qkv = qkv.reshape(qkv.shape[-3:])
    cos, sin = cos.reshape(-1), sin.reshape(-1)
    if qkv.is_cuda and supported(qkv, k_cache, v_cache):
        counts = qkv.new_zeros(0, dtype=torch.int32) if counts is None else counts
        q_norm, k_norm, eps = norms if norms is not None else (qkv.new_zeros(0), qkv.new_zeros(0), 0.0)
        return torch.ops.paratron.decode_rotary_attention(qkv.contiguous(), cos.contiguous(), sin.contiguous(),
                                                          k_cache, v_cache, pad, slot, scale, splits, counts, pdl,
                                                          q_norm.contiguous(), k_norm.contiguous(), eps,
                                                          (EARLY_T if pdl else 0) if early is None else early)
    return decode_rotary_reference(qkv, cos, sin, k_cache, v_cache, pad, slot, scale, norms)


if triton is not None:
    from .paged_attention import _absorb, _combined, _paged_combine_kernel, _walk
    from .rotary import _round  # (rounds to bf16 as torch does, on the GPU and in the interpreter)

    @triton.jit
    def _rotated(base, offsets, partner, sign, mask, c, s, w_ptr, cols, pcols, eps, NORM: tl.constexpr,
                 D: tl.constexpr):
        """The values at ``base + offsets`` rotated (rotate-half: each paired with ``base + partner``, signed by
        ``sign``) with cos ``c`` / sin ``s``, rounded as the model's apply_rotary in their dtype (each product,
        then the sum); fp32 of those values. ``NORM``: each head (a row of ``offsets``: the whole head) first
        RMS-normalised and times the norm's weight at ``w_ptr`` (columns ``cols``, the partners' ``pcols``), rounded
        as the model's Norm (the normalised values, then their product with the weight)."""
        dt: tl.constexpr = base.dtype.element_ty
        x = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
            x = _round(_round(x * rstd, dt) * tl.load(w_ptr + cols).to(tl.float32), dt)
            xp = _round(_round(xp * rstd, dt) * tl.load(w_ptr + pcols).to(tl.float32), dt)
        return _round(_round(x * c, dt) + _round(sign * xp * s, dt), dt)

    @triton.jit
    def _qk(base, heads, live, cols, c, s, qn_ptr, kn_ptr, eps, QPG: tl.constexpr, D: tl.constexpr,
            NORM: tl.constexpr):
        """(the query heads [QB, D], the key [D]) of one group's row of qkv at ``base``, (normalised and) rotated."""
        partner = (cols + D // 2) % D  # rotate-half: [-x2, x1]
        sign = tl.where(cols < D // 2, -1.0, 1.0)
        rows = heads[:, None] * D
        q = _rotated(base, rows + cols[None, :], rows + partner[None, :], sign[None, :], live[:, None], c[None, :],
                     s[None, :], qn_ptr, cols[None, :], partner[None, :], eps, NORM, D)
        k = _rotated(base + QPG * D, cols, partner, sign, cols < D, c, s, kn_ptr, cols, partner, eps, NORM, D)
        return q, k

    @triton.jit
    def _first_block(k_ptr, v_ptr, lo, hi, skt, svt, cols, BT: tl.constexpr):
        """The keys and values of slots [lo, lo + BT) below ``hi`` of one group's contiguous cache, and which are."""
        t = lo + tl.arange(0, BT)
        ok = t < hi
        keys = tl.load(k_ptr + t[:, None] * skt + cols[None, :], mask=ok[:, None], other=0.0)
        vals = tl.load(v_ptr + t[:, None] * svt + cols[None, :], mask=ok[:, None], other=0.0)
        return keys, vals, ok

    @triton.jit
    def _preloaded(q, keys, vals, ok, scale, QB: tl.constexpr, D: tl.constexpr):
        """The online softmax (``_absorb``) of ``q`` over one block of cached keys and values loaded beforehand."""
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(keys.to(tl.float32))) * scale, float("-inf"))
        return _absorb(s, vals.to(tl.float32), tl.full([QB], float("-inf"), tl.float32), tl.zeros([QB], tl.float32),
                       tl.zeros([QB, D], tl.float32))

    @triton.jit
    def _merged(m1, total1, acc1, m2, total2, acc2):
        """Two online softmaxes over disjoint keys as one: each rescaled to the larger max (empty ones weigh 0)."""
        m = tl.maximum(m1, m2)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w1, w2 = tl.exp(m1 - m_safe), tl.exp(m2 - m_safe)
        return m, total1 * w1 + total2 * w2, acc1 * w1[:, None] + acc2 * w2[:, None]

    @triton.jit
    def _span(slot_ptr, pad_ptr, splits, sp, BT: tl.constexpr):
        """(the step's slot, [lo, hi)): split ``sp``'s share of the cached slots, whole blocks of ``BT`` each."""
        slot = tl.load(slot_ptr)
        first = tl.load(pad_ptr)
        chunk = (slot - first + splits - 1) // splits
        chunk = (chunk + BT - 1) // BT * BT
        lo = first + sp * chunk
        return slot, lo, tl.minimum(slot, lo + chunk)

    @triton.jit
    def _with_new(q, k_new, v_new, last, scale, m, total, acc):
        """The online softmax (``m``, ``total``, ``acc``) with the new token's key and value from registers taken in
        (by the split of the last cached slots, ``last``; the others take nothing)."""
        s_new = tl.where(last, tl.sum(q * k_new[None, :], 1) * scale, float("-inf"))  # [QB]
        m_new = tl.maximum(m, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s_new - m_safe)
        return m_new, total * alpha + p, acc * alpha[:, None] + p[:, None] * v_new[None, :]

    @triton.jit
    def _group_walk(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pad_ptr, g, sp, splits, slot, lo, hi, scale, skg, skt,
                    svg, svt, qn_ptr, kn_ptr, eps, QPG: tl.constexpr, QB: tl.constexpr, D: tl.constexpr,
                    BT: tl.constexpr, NORM: tl.constexpr):
        """Group ``g``'s (rotated queries [QB, D], rotated key [D], value [D], and the online softmax over cached
        slots [lo, hi): max, denominator, unnormalised sum) for split ``sp`` of ``splits``: the last split also
        writes the new token's key and value at ``slot`` (and attends to them from registers: ``_with_new``)."""
        dt = qkv_ptr.dtype.element_ty
        cols = tl.arange(0, D)
        heads = tl.arange(0, QB)
        c = _round(tl.load(cos_ptr + cols).to(tl.float32), dt)
        s = _round(tl.load(sin_ptr + cols).to(tl.float32), dt)
        base = qkv_ptr + g * (QPG + 2) * D
        q, k_new = _qk(base, heads, heads < QPG, cols, c, s, qn_ptr, kn_ptr, eps, QPG, D, NORM)  # [QB, D], [D]
        v_new = tl.load(base + (QPG + 1) * D + cols).to(tl.float32)
        writes = (cols * 0 + sp) == splits - 1  # [D]
        tl.store(k_ptr + g * skg + slot * skt + cols, k_new.to(dt), mask=writes)
        tl.store(v_ptr + g * svg + slot * svt + cols, v_new.to(dt), mask=writes)
        # the paged kernels' key loop over the row's cache as one block of a pool (block stride 0: the block number
        # it reads from its "table", here the padding count, multiplies nothing; a block size past any slot)
        m, total, acc = _walk(q, k_ptr, v_ptr, pad_ptr, lo, hi, g, scale, 0, skt, skg, 0, svt, svg, cols, QB, D,
                              1 << 30, BT)
        return q, k_new, v_new, m, total, acc

    @triton.jit
    def _decode_rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pad_ptr, slot_ptr, out_ptr, m_ptr, l_ptr,
                              acc_ptr, count_ptr, splits, scale, skg, skt, svg, svt, sog, soh, qn_ptr, kn_ptr, eps,
                              QPG: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                              SPLIT: tl.constexpr, ARRIVE: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr,
                              EARLY: tl.constexpr):
        """Program (group g, split sp): the rotations, the cache write, the attention (the module docstring). With
        ``PDL`` (launched early: programmatic dependent launch) it waits for the kernel before, which wrote qkv, after
        reading what that kernel does not write: the slot, the padding and (``EARLY``) the first cached slots (written
        by earlier steps; the walk goes on past them). ``NORM``: the query and key heads RMS-normalised first (weights
        at ``qn_ptr``, ``kn_ptr``; ``eps``)."""
        g, sp = tl.program_id(0), tl.program_id(1)
        dt = qkv_ptr.dtype.element_ty
        cols = tl.arange(0, D)
        slot, lo, hi = _span(slot_ptr, pad_ptr, splits, sp, BT)
        if EARLY > 0:  # (cache slots of earlier steps: the kernel before does not write them)
            keys, vals, ok = _first_block(k_ptr + g * skg, v_ptr + g * svg, lo, hi, skt, svt, cols, EARLY)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        heads = tl.arange(0, QB)
        live = heads < QPG
        q, k_new, v_new, m, total, acc = _group_walk(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pad_ptr, g, sp, splits,
                                                     slot, lo + EARLY, hi, scale, skg, skt, svg, svt, qn_ptr, kn_ptr,
                                                     eps, QPG, QB, D, BT, NORM)
        if EARLY > 0:
            m, total, acc = _merged(*_preloaded(q, keys, vals, ok, scale, QB, D), m, total, acc)
        m_new, total, acc = _with_new(q, k_new, v_new, sp == splits - 1, scale, m, total, acc)
        if SPLIT:  # partials [groups, splits, QPG(, D)], the paged engine's combine layout (one token)
            at = (g * splits + sp) * QPG + heads
            tl.store(m_ptr + at, m_new, mask=live)
            tl.store(l_ptr + at, total, mask=live)
            tl.store(acc_ptr + at[:, None] * D + cols[None, :], acc, mask=live[:, None])
            if ARRIVE:  # the group's last split to arrive combines them (its count set back to 0 for the next call)
                tl.debug_barrier()  # every thread's partials stored before the count says so
                if tl.atomic_add(count_ptr + g, 1, sem="acq_rel") == splits - 1:
                    tl.store(count_ptr + g, 0)
                    _, total, acc = _combined(m_ptr, l_ptr, acc_ptr, g * splits * QPG + heads, splits, live, cols,
                                              QB, D, QPG)
                    tl.store(out_ptr + g * sog + heads[:, None] * soh + cols[None, :], (acc / total[:, None]).to(dt),
                             mask=live[:, None])
        else:
            out = acc / total[:, None]
            tl.store(out_ptr + g * sog + heads[:, None] * soh + cols[None, :], out.to(dt), mask=live[:, None])

    @torch.library.custom_op("paratron::decode_rotary_attention", mutates_args=("k_cache", "v_cache", "counts"))
    def _decode_rotary_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, pad: torch.Tensor, slot: torch.Tensor, scale: float,
                          splits: int, counts: torch.Tensor, pdl: bool, q_norm: torch.Tensor, k_norm: torch.Tensor,
                          eps: float, early: int) -> torch.Tensor:
        """``counts``: int32 zeros, one per group at least (:func:`decode_rotary_attention`), or empty: none;
        ``pdl``: launched for programmatic dependent launch (``--kernel-decode-pdl``); ``q_norm``, ``k_norm``: the
        query and key heads' RMSNorm weights (``eps``), or empty: none; ``early``: cached slots each split loads at its
        start (before its wait under ``pdl``; eight warps past 64), then walks on from there.
        (Every argument is given: torch 2.11 drops a mutated optional argument left at its default from the call
        and then fails to find it.)"""
        groups, rows, d = qkv.shape
        qpg = rows - 2
        out = qkv.new_empty(1, groups, qpg, d)
        pdl = early_launch(pdl, qkv)
        if splits <= 0:
            splits = (fused_splits(groups, k_cache.size(2), _sms(qkv.device)) if counts.numel()
                      else decode_splits(groups, k_cache.size(2), _sms(qkv.device)))
        qb = max(16, triton.next_power_of_2(qpg))
        split = splits > 1
        m = total = acc = out  # (unused without splits)
        if split:
            m, total = (torch.empty(groups, splits, qpg, device=qkv.device, dtype=torch.float32) for _ in range(2))
            acc = torch.empty(groups, splits, qpg, d, device=qkv.device, dtype=torch.float32)
        arrive = split and counts.numel() > 0
        norm = q_norm.numel() > 0
        with torch.cuda.device(qkv.device) if qkv.is_cuda else contextlib.nullcontext():
            _decode_rotary_kernel[(groups, splits)](
                qkv, cos, sin, k_cache, v_cache, pad, slot, out, m, total, acc, counts if arrive else out, splits,
                scale, k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), out.stride(1),
                out.stride(2), q_norm if norm else out, k_norm if norm else out, eps,
                QPG=qpg, QB=qb, D=d, BT=BLOCK_T, SPLIT=split, ARRIVE=arrive, PDL=pdl, NORM=norm, EARLY=early,
                num_warps=8 if early > BLOCK_T else 4, **({"launch_pdl": True} if pdl else {}))
            if split and not arrive:
                _paged_combine_kernel[(groups,)](m, total, acc, out, out, groups, splits, out.stride(0),
                                                 out.stride(1), out.stride(2), QPG=qpg, QB=qb, D=d, SINK=False)
        return out

    @_decode_rotary_op.register_fake
    def _(qkv, cos, sin, k_cache, v_cache, pad, slot, scale, splits, counts, pdl, q_norm, k_norm, eps, early):
        return qkv.new_empty(1, qkv.size(0), qkv.size(1) - 2, qkv.size(2))

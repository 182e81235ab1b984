"""Attention of packed query tokens over a paged KV cache (the paged engine's steps), as Triton kernels.

A step of the paged engine (paratron/inference/paged.py) packs the new tokens of every request it runs (one per
decoding request, a chunk of the prompt per prefilling one) into one sequence. Token ``i`` belongs to the
request of block-table row ``rows[i]`` and sees that request's first ``lengths[i]`` cached tokens (itself and
everything before it: causal within its request). The keys and values live in one pool per layer,
``[num_blocks, block_size, groups, d]``; cached token ``t`` of row ``r`` is at block ``tables[r, t //
block_size]``, slot ``t % block_size``.

q is ``[tokens, groups, q_per_group, d]`` (each key/value group's query heads read its keys once). The kernel
runs one program per (token, group) and walks the token's blocks ``BLOCK_T`` keys at a time, looking each key's
block up in the table (any block size works), with the online softmax of decode_attention.py. Lengths, rows and
tables are read from device memory, so a captured CUDA graph replays it with new ones.

Split context (flash-decoding): when the (token, group) programs are too few to fill the GPU (small decode
batches), each token's context is shared by ``splits`` programs instead. Split ``s`` walks the ``s``-th chunk of
the token's visible positions [first, end) (chunks of a multiple of ``BLOCK_T``, sized from that token's own
length, so splits past a short context see no key and stay empty) and writes its partial online softmax (running
max, denominator, unnormalised weighted sum) in fp32; a second small kernel rescales the splits to their common
max, adds the sink logit once, and normalises. :func:`decode_splits` picks the split count on the host from the
shapes alone (tokens x groups, the tables' width, the GPU's multiprocessors), so a captured graph replays one grid;
with one split the single-pass kernel runs alone. ``splits`` forces a count.

Prompt chunks: with ``tiles`` ([n_tiles, 2]: the first packed token of each tile and how many, consecutive
tokens of one request) the kernel runs one program per (tile, group) instead, its tokens' queries in one tile
(``tile_tokens`` of them): the tile's keys and values are read once for all its tokens rather than once per
token, each token still seeing only its own first ``lengths[i]`` (causal within the tile). A tile's query rows
(its tokens x the group's query heads) are a compile-time size, so tiles of a few tokens (the decodes beside
prompt chunks in a mixed step: one token, four of 64 rows at llama's grouping) run in a second launch of a
narrower kernel; each launch passes over the tiles the other takes. With a 16-bit cache on a GPU the tiled kernel
multiplies in that dtype (bf16 tensor-core dots accumulating in fp32, the weights rounded to bf16 before they
multiply the values, as flash attention does) and walks ``TILE_BLOCK_T`` keys a step.

:func:`paged_attention_reference` is the same in plain torch (each token's blocks gathered into a dense
sequence): what runs on CPUs and what the tests compare the kernel with (on CPU through Triton's interpreter).
"""
from __future__ import annotations

import contextlib

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_T = 64  # cached keys per loop iteration


def paged_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                              rows: torch.Tensor, lengths: torch.Tensor, scale: float, window: Optional[int] = None,
                              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale over each token's first ``lengths[i]`` cached tokens) v, in fp32, in q's dtype.
    ``window``: only the last ``window + 1`` of them (a sliding window of LEFT = ``window``); ``sinks``: a logit
    per query head [g * qpg] that joins each softmax's denominator and attends to nothing (gpt-oss's sinks)."""
    n, g, qpg, d = q.shape
    bs = k_pool.size(1)
    table = tables[rows]  # [n, blocks]
    span = table.size(1) * bs
    keys = k_pool[table].reshape(n, span, g, d).permute(0, 2, 1, 3)  # [n, g, span, d]
    vals = v_pool[table].reshape(n, span, g, d).permute(0, 2, 1, 3)
    at = torch.arange(span, device=q.device)[None, :]
    allowed = at < lengths[:, None]
    if window is not None:
        allowed = allowed & (at >= lengths[:, None] - 1 - window)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    # the softmax spelled out: torch's CPU softmax splits even tiny inputs over its threads, which waits
    # tens of milliseconds per call on a busy machine
    top = scores.amax(-1, keepdim=True)
    sink = None if sinks is None else sinks.float().view(1, g, qpg, 1)
    if sink is not None:
        top = torch.maximum(top, sink)
    probs = (scores - top).exp()
    total = probs.sum(-1, keepdim=True) + (0 if sink is None else (sink - top).exp())
    return torch.matmul(probs / total, vals.float()).to(q.dtype)


@torch.library.custom_op("paratron::paged_store", mutates_args=("pool",))
def paged_store(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows`` [n, ...] into ``pool`` [num_blocks, block_size, ...] at the flat token slots ``slots`` [n], in
    place. An operator of its own so that a compiled step writes the pool where it lies: Inductor took the plain
    ``index_copy_`` into a view of the pool as a copy of the whole pool per layer on a GPU (gigabytes at a pool
    sized to the free memory)."""
    pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, rows.to(pool.dtype))


@paged_store.register_fake
def _(pool, slots, rows):
    return None


TILE_ROWS = 64  # query rows (tokens x a group's query heads) of one program of the tiled kernel
TILE_BLOCK_T = 128  # cached keys per loop iteration of the tiled kernel (its bf16 dots: wider steps pay)


def tile_tokens(q_per_group: int) -> int:
    """Tokens per tile of the tiled kernel for ``q_per_group`` query heads per key/value group."""
    return max(1, TILE_ROWS // _pow2(q_per_group))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _tile_launches(qp: int, per: int) -> list[tuple[int, int, int]]:
    """(fewest tokens, most tokens, rows' tokens) of each launch of the tiled kernel, for ``qp`` query rows per token
    (a power of two) and tiles of up to ``per`` tokens: tiles of a few tokens (the decodes beside prompt chunks in
    a mixed step) in a launch of as many query rows as they fill (16 at least, an MMA's), the full tiles in one of
    ``per`` tokens. One launch where the two would be the same."""
    few = max(1, 16 // qp)
    return [(1, per, per)] if few >= per else [(1, few, few), (few + 1, per, per)]


def tiles_of(chunks: list[int], q_per_group: int) -> list[list[int]]:
    """[first token, count] of each tile of packed chunks of ``chunks[j]`` consecutive tokens each (one request
    each, in packing order)."""
    per, out, base = tile_tokens(q_per_group), [], 0
    for n in chunks:
        out += [[base + k, min(per, n - k)] for k in range(0, n, per)]
        base += n
    return out


def supported(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """The kernel's shapes: a power-of-two head dim of 16..256, at most 128 queries per group, the pool
    contiguous along the head dim."""
    d = q.size(-1)
    return triton is not None and 16 <= d <= 256 and d & (d - 1) == 0 and q.size(2) <= 128 and k_pool.stride(-1) == 1


SPLIT_TARGET = 2  # programs per streaming multiprocessor the split path aims for
SPLIT_MIN_SPAN = 4 * BLOCK_T  # cached positions of the widest context each split is given at least
DEFAULT_SMS = 132  # streaming multiprocessors assumed off CUDA (an H100 / H200's)


def decode_splits(programs: int, span: int, sms: int) -> int:
    """How many programs share each (token, group)'s context: 1 (the single-pass kernel) when the ``programs``
    (tokens x groups) already give every one of the ``sms`` multiprocessors ``SPLIT_TARGET`` of them; else enough
    splits to reach that, but no more than leave each split ``SPLIT_MIN_SPAN`` positions of ``span``, the widest
    context the block tables can describe (their width x the block size). Shapes only: a captured CUDA graph
    replays one grid whatever its lengths."""
    if programs <= 0 or programs >= SPLIT_TARGET * sms:
        return 1
    return max(1, min(-(-SPLIT_TARGET * sms // programs), span // SPLIT_MIN_SPAN))


def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``DEFAULT_SMS`` off CUDA, e.g. under Triton's interpreter; torch
    caches the device's properties)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                    rows: torch.Tensor, lengths: torch.Tensor, scale: float, kernel: bool = True,
                    window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
                    tiles: Optional[torch.Tensor] = None, splits: int = 0) -> torch.Tensor:
    """``[tokens, groups, q_per_group, d]``: the Triton kernel on CUDA where it applies (``kernel``; the tiled one
    with ``tiles``), else the reference; ``window`` / ``sinks`` as the reference's; ``splits``: programs per token
    and group of the decode kernel (0: :func:`decode_splits`'s choice)."""
    if kernel and q.is_cuda and supported(q, k_pool):
        args = (q.contiguous(), k_pool, v_pool, tables, rows, lengths)
        rest = (-1 if window is None else window, None if sinks is None else sinks.float().contiguous())
        if tiles is not None:
            return torch.ops.paratron.paged_prefill(*args, tiles, scale, *rest)
        return torch.ops.paratron.paged_attention(*args, scale, *rest, splits)
    return paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, scale, window, sinks)


if triton is not None:
    @triton.jit
    def _cached(ptr, block, t, ok, sb, st, sg, g, cols, BS: tl.constexpr, LOWP: tl.constexpr = False):
        """Cached tokens ``t`` of group ``g`` (in blocks ``block``, slot t % BS) as [len(t), D], fp32 (``LOWP``: in
        the cache's own dtype); zeros where not ``ok``."""
        at = block * sb + (t % BS) * st + g * sg
        x = tl.load(ptr + at[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        return x if LOWP else x.to(tl.float32)

    @triton.jit
    def _absorb(s, vals, m, total, acc):
        """Scores ``s`` [rows, keys] (-inf: not seen) and their values [keys, D] into each row's online softmax
        (running max ``m``, denominator ``total``, weighted sum ``acc``); a row that has seen no key stays empty."""
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        return m_new, total * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)

    @triton.jit
    def _sunk(sink, m, total, acc):
        """(denominator, weighted sum) with each row's sink logit in the denominator (it attends to nothing)."""
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        return total * alpha + tl.exp(sink - m_safe), acc * alpha[:, None]

    @triton.jit
    def _walk(q, k_ptr, v_ptr, table, lo, hi, g, scale, skb, skt, skg, svb, svt, svg, cols,
              QB: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, row_lo=0, row_hi=1 << 30,
              LOWP: tl.constexpr = False):
        """The online softmax (running max, denominator, unnormalised weighted sum) of the query rows ``q``
        [QB, D] over the cached tokens [lo, hi) of group ``g``, ``BT`` at a time; all empty where lo >= hi. Each
        row sees only [row_lo, row_hi) of them (column vectors [QB, 1]: a tile's tokens, each its own span).
        ``LOWP``: q, keys, values and the weights multiply in the cache's dtype (bf16 tensor-core dots, fp32
        sums) rather than fp32's (TF32 dots)."""
        m = tl.full([QB], float("-inf"), tl.float32)
        total = tl.zeros([QB], tl.float32)
        acc = tl.zeros([QB, D], tl.float32)
        for start in range(lo, hi, BT):
            t = start + tl.arange(0, BT)
            ok = t < hi
            block = tl.load(table + t // BS, mask=ok, other=0).to(tl.int64)
            keys = _cached(k_ptr, block, t, ok, skb, skt, skg, g, cols, BS, LOWP)
            s = tl.dot(q, tl.trans(keys)) * scale
            seen = ok[None, :] & (t[None, :] >= row_lo) & (t[None, :] < row_hi)
            s = tl.where(seen, s, float("-inf"))
            vals = _cached(v_ptr, block, t, ok, svb, svt, svg, g, cols, BS, LOWP)
            m, total, acc = _absorb(s, vals, m, total, acc)
        return m, total, acc

    @triton.jit
    def _paged_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, row_ptr, len_ptr, out_ptr, sink_ptr, groups, scale, window, stab,
                      sqn, sqg, sqh, skb, skt, skg, svb, svt, svg, son, sog, soh,
                      QPG: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
                      SINK: tl.constexpr):
        pid = tl.program_id(0)
        i, g = pid // groups, pid % groups
        heads, cols = tl.arange(0, QB), tl.arange(0, D)
        q = tl.load(q_ptr + i * sqn + g * sqg + heads[:, None] * sqh + cols[None, :], mask=heads[:, None] < QPG,
                    other=0.0).to(tl.float32)
        table = tab_ptr + tl.load(row_ptr + i) * stab
        end = tl.load(len_ptr + i)  # this token sees cached tokens [first, end)
        # (window < 0: none; one expression of the loaded length's type, Triton's ternary needs one type)
        first = tl.where(window >= 0, tl.maximum(end - 1 - window, 0), 0).to(end.dtype)
        m, total, acc = _walk(q, k_ptr, v_ptr, table, first, end, g, scale, skb, skt, skg, svb, svt, svg, cols,
                              QB, D, BS, BT)
        if SINK:  # the head's sink logit joins the denominator and attends to nothing
            sink = tl.load(sink_ptr + g * QPG + heads, mask=heads < QPG, other=float("-inf"))
            total, acc = _sunk(sink, m, total, acc)
        out = acc / total[:, None]
        tl.store(out_ptr + i * son + g * sog + heads[:, None] * soh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=heads[:, None] < QPG)

    @triton.jit
    def _paged_split_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, row_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, groups, splits,
                            scale, window, stab, sqn, sqg, sqh, skb, skt, skg, svb, svt, svg,
                            QPG: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            BT: tl.constexpr):
        """Split ``program_id(1)`` of token x group ``program_id(0)``: its share of the token's cached tokens
        [first, end), in chunks of a multiple of ``BT``, into fp32 partials (max, denominator, unnormalised sum)
        [tokens * groups, splits, QPG(, D)]; a split past the token's end stays empty (-inf, 0, 0)."""
        pid, s = tl.program_id(0), tl.program_id(1)
        i, g = pid // groups, pid % groups
        heads, cols = tl.arange(0, QB), tl.arange(0, D)
        q = tl.load(q_ptr + i * sqn + g * sqg + heads[:, None] * sqh + cols[None, :], mask=heads[:, None] < QPG,
                    other=0.0).to(tl.float32)
        table = tab_ptr + tl.load(row_ptr + i) * stab
        end = tl.load(len_ptr + i)
        first = tl.where(window >= 0, tl.maximum(end - 1 - window, 0), 0).to(end.dtype)
        chunk = (end - first + splits - 1) // splits
        chunk = (chunk + BT - 1) // BT * BT  # every split starts BT-aligned from first; splits * chunk >= end - first
        lo = first + s * chunk
        hi = tl.minimum(end, lo + chunk)
        m, total, acc = _walk(q, k_ptr, v_ptr, table, lo, hi, g, scale, skb, skt, skg, svb, svt, svg, cols,
                              QB, D, BS, BT)
        at = (pid * splits + s) * QPG + heads
        live = heads < QPG
        tl.store(m_ptr + at, m, mask=live)
        tl.store(l_ptr + at, total, mask=live)
        tl.store(acc_ptr + at[:, None] * D + cols[None, :], acc, mask=live[:, None])

    @triton.jit
    def _combined(m_ptr, l_ptr, acc_ptr, base, splits, live, cols, QB: tl.constexpr, D: tl.constexpr,
                  QPG: tl.constexpr):
        """The ``splits`` partials at ``base + s * QPG`` (heads ``live``), each rescaled to their common max: (that
        max, the denominator, the unnormalised sum [QB, D]). Read past the L1 cache: other programs wrote them."""
        top = tl.full([QB], float("-inf"), tl.float32)
        for s in range(splits):
            top = tl.maximum(top, tl.load(m_ptr + base + s * QPG, mask=live, other=float("-inf"), cache_modifier=".cg"))
        top_safe = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: every weight below is 0
        total = tl.zeros([QB], tl.float32)
        acc = tl.zeros([QB, D], tl.float32)
        for s in range(splits):
            at = base + s * QPG
            w = tl.exp(tl.load(m_ptr + at, mask=live, other=float("-inf"), cache_modifier=".cg") - top_safe)
            total += w * tl.load(l_ptr + at, mask=live, other=0.0, cache_modifier=".cg")
            acc += w[:, None] * tl.load(acc_ptr + at[:, None] * D + cols[None, :], mask=live[:, None], other=0.0,
                                        cache_modifier=".cg")
        return top, total, acc

    @triton.jit
    def _paged_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, sink_ptr, groups, splits, son, sog, soh,
                              QPG: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr):
        """The splits' partials of token x group ``program_id(0)``, each rescaled to their common max, plus the
        sink logit (once), normalised into ``out`` in its dtype."""
        pid = tl.program_id(0)
        i, g = pid // groups, pid % groups
        heads, cols = tl.arange(0, QB), tl.arange(0, D)
        live = heads < QPG
        top, total, acc = _combined(m_ptr, l_ptr, acc_ptr, pid * splits * QPG + heads, splits, live, cols, QB, D, QPG)
        if SINK:
            sink = tl.load(sink_ptr + g * QPG + heads, mask=live, other=float("-inf"))
            total, acc = _sunk(sink, top, total, acc)
        out = acc / total[:, None]
        tl.store(out_ptr + i * son + g * sog + heads[:, None] * soh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @torch.library.custom_op("paratron::paged_attention", mutates_args=())
    def _paged_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                  rows: torch.Tensor, lengths: torch.Tensor, scale: float, window: int = -1,
                  sinks: Optional[torch.Tensor] = None, splits: int = 0) -> torch.Tensor:
        """``window`` -1: none; ``sinks``: fp32 [groups * q_per_group] or None; ``splits``: how many programs share
        each token's context (0: :func:`decode_splits` of the shapes; 1: the single-pass kernel)."""
        n, groups, qpg, d = q.shape
        out = torch.empty_like(q)
        if not out.numel():
            return out
        if splits <= 0:
            splits = decode_splits(n * groups, tables.size(1) * k_pool.size(1), _sms(q.device))
        qb = max(16, triton.next_power_of_2(qpg))
        common = (groups, scale, window, tables.stride(0), q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0),
                  k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2))
        sink = q if sinks is None else sinks
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            if splits == 1:
                _paged_kernel[(n * groups,)](
                    q, k_pool, v_pool, tables, rows, lengths, out, sink, *common, out.stride(0), out.stride(1),
                    out.stride(2), QPG=qpg, QB=qb, D=d, BS=k_pool.size(1), BT=BLOCK_T, SINK=sinks is not None)
                return out
            m, total = (torch.empty(n * groups, splits, qpg, device=q.device, dtype=torch.float32) for _ in range(2))
            acc = torch.empty(n * groups, splits, qpg, d, device=q.device, dtype=torch.float32)
            _paged_split_kernel[(n * groups, splits)](
                q, k_pool, v_pool, tables, rows, lengths, m, total, acc, groups, splits, *common[1:],
                QPG=qpg, QB=qb, D=d, BS=k_pool.size(1), BT=BLOCK_T)
            _paged_combine_kernel[(n * groups,)](
                m, total, acc, out, sink, groups, splits, out.stride(0), out.stride(1), out.stride(2),
                QPG=qpg, QB=qb, D=d, SINK=sinks is not None)
        return out

    @_paged_op.register_fake
    def _(q, k_pool, v_pool, tables, rows, lengths, scale, window=-1, sinks=None, splits=0):
        return torch.empty_like(q)


if triton is not None:
    @triton.jit
    def _paged_tile_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, row_ptr, len_ptr, tile_ptr, out_ptr, sink_ptr, groups, scale,
                           window, stab, sqn, sqg, sqh, skb, skt, skg, svb, svt, svg, son, sog, soh, least, most,
                           QPG: tl.constexpr, QP: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                           BT: tl.constexpr, SINK: tl.constexpr, LOWP: tl.constexpr):
        """The tiles of ``least`` .. ``most`` tokens (the others: left to the launch sized for them); ``LOWP``: as
        :func:`_walk`'s."""
        pid = tl.program_id(0)
        tile, g = pid // groups, pid % groups
        first_token, count = tl.load(tile_ptr + 2 * tile), tl.load(tile_ptr + 2 * tile + 1)
        count = tl.where((count >= least) & (count <= most), count, 0)  # 0: no row valid, nothing read or written
        r, cols = tl.arange(0, R), tl.arange(0, D)
        j, h = r // QP, r % QP  # row r: the tile's token j, the group's query head h
        valid = (j < count) & (h < QPG)
        tok = first_token + j
        q = tl.load(q_ptr + tok[:, None] * sqn + g * sqg + h[:, None] * sqh + cols[None, :], mask=valid[:, None],
                    other=0.0)
        q = q if LOWP else q.to(tl.float32)
        end = tl.load(len_ptr + tok, mask=valid, other=0)  # row r's token sees cached tokens [lo, end)
        lo = tl.where(window >= 0, tl.maximum(end - 1 - window, 0), 0).to(end.dtype)
        table = tab_ptr + tl.load(row_ptr + first_token) * stab
        start0 = tl.min(tl.where(valid, lo, 1 << 30))
        m, total, acc = _walk(q, k_ptr, v_ptr, table, start0, tl.max(end), g, scale, skb, skt, skg, svb, svt, svg,
                              cols, R, D, BS, BT, lo[:, None], end[:, None], LOWP)
        if SINK:
            sink = tl.load(sink_ptr + g * QPG + h, mask=valid, other=float("-inf"))
            total, acc = _sunk(sink, m, total, acc)
        out = acc / total[:, None]
        tl.store(out_ptr + tok[:, None] * son + g * sog + h[:, None] * soh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None])

    @torch.library.custom_op("paratron::paged_prefill", mutates_args=())
    def _paged_prefill_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                          rows: torch.Tensor, lengths: torch.Tensor, tiles: torch.Tensor, scale: float,
                          window: int = -1, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tiled kernel: ``tiles`` [n_tiles, 2] (first packed token, count) of consecutive tokens of one row.
        16-bit caches on a GPU multiply in their own dtype (``LOWP``); Triton's interpreter multiplies bf16 as
        its raw bits, so off CUDA the dots stay in fp32."""
        n, groups, qpg, d = q.shape
        out = torch.empty_like(q)
        if out.numel() and tiles.numel():
            qp, per = _pow2(qpg), tile_tokens(qpg)
            tiles = tiles.contiguous()
            with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
                for least, most, tokens in _tile_launches(qp, per):
                    _paged_tile_kernel[(tiles.size(0) * groups,)](
                        q, k_pool, v_pool, tables, rows, lengths, tiles, out,
                        q if sinks is None else sinks, groups, scale, window, tables.stride(0), q.stride(0),
                        q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
                        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1),
                        out.stride(2), least, most, QPG=qpg, QP=qp, R=max(16, qp * tokens), D=d, BS=k_pool.size(1),
                        BT=TILE_BLOCK_T, SINK=sinks is not None, LOWP=q.is_cuda and q.element_size() == 2)
        return out

    @_paged_prefill_op.register_fake
    def _(q, k_pool, v_pool, tables, rows, lengths, tiles, scale, window=-1, sinks=None):
        return torch.empty_like(q)

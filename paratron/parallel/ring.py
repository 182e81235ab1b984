"""Ring attention: causal self-attention over a sequence split into 2 x CP chunks (context.py), each
rank holding query chunks ``r`` and ``2 CP - 1 - r`` and the keys/values of the same positions.

Forward, step ``j`` of ``CP``: the rank attends its queries to the K/V block of rank ``src = r - j``
(its own at step 0) while it sends that block to the next rank and receives the next one from the
previous rank (``isend``/``irecv``, overlapped with the block's attention). Which part of the block
it needs follows from the chunk order (``block_plan``):

- ``src == r``: the rank's own K/V, causal over its two chunks in order (the diagonal blocks);
- ``src < r``: only the key chunk ``src`` comes before both query chunks: all queries against the
  first half of the block, unmasked (the block's second chunk comes after both query chunks);
- ``src > r``: only the second query chunk (``2 CP - 1 - r``) comes after both key chunks: that
  half of the queries against the whole block, unmasked.

Every causal block pair is thus done exactly once, and each rank does the same work. Each block
returns its output and log-sum-exp (LSE) per query row; outputs are merged in fp32 with
``o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``, ``lse = logaddexp(lse_a, lse_b)``.

Backward (explicit, an autograd Function): the K/V blocks go around the ring again; at each step
the rank computes its block's dQ (kept) and dK/dV, which it adds to the dK/dV accumulator that
travels with the block (fp32), then sends that accumulator on. After CP steps every accumulator has
visited every rank and one last hop brings it home to the owner of its K/V. The per-block backward
uses the final output and LSE of the forward (as flash attention's backward does), so no block's
forward is recomputed and nothing of the other ranks' K/V is kept between forward and backward.

``--cp-comm-type allgather`` (``AllGatherAttention``) does the same blocks with the same kernels in the
same order, but gets every rank's K/V from one all-gather (again in the backward) and sends the dK/dV
of every block home in one reduce-scatter: fewer, larger messages, none overlapped with compute.

Packed documents: with document ids (``--reset-attention-mask``) each block pair also masks keys of
other documents; the ids of the whole sequence are on every rank (a few bytes a token), so each
rank slices the key chunks' ids itself and nothing extra travels.

Kernels (``kernel_for``): on CUDA with bf16/fp16 and no document mask, torch's flash-attention ops
(``aten._scaled_dot_product_flash_attention`` and its backward), which return the LSE and take the
final output and LSE in the backward; on CUDA with document masks the memory-efficient ops (the same
contract, the mask as an additive bias); otherwise a plain math implementation in fp32 (CPU, the
tests' reference). docs/design.md says why.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import all_gather_single, reduce_scatter_single

NEG_INF = float("-inf")


def masked_value(dtype: torch.dtype) -> float:
    """What the additive masks of the fused kernels put on masked keys: half the dtype's lowest finite
    value. With -inf, a row whose every key is masked in a block makes the memory-efficient kernel's
    backward compute -inf - (-inf) = NaN (seen on an H100); exp(masked - lse) is 0 all the same."""
    return torch.finfo(dtype).min / 2


# ---- which part of a K/V block a rank attends to -------------------------------------------------
class Block(NamedTuple):
    rows: slice  # query rows of this rank taking part
    cols: slice  # key columns of the block taking part
    causal: bool  # the diagonal blocks: causal over the rank's two chunks in order


def block_plan(rank: int, src: int, chunk: int) -> Block:
    """The work of rank ``rank`` on the K/V block of rank ``src`` (chunks of ``chunk`` tokens)."""
    if src == rank:
        return Block(slice(None), slice(None), True)
    if src < rank:
        return Block(slice(None), slice(0, chunk), False)
    return Block(slice(chunk, None), slice(None), False)


def chunk_positions(rank: int, cp: int, chunk: int, device=None) -> torch.Tensor:
    """Global positions of the tokens rank ``rank`` holds: chunks rank and 2 CP - 1 - rank."""
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


# ---- kernels: (q [b,h,sq,d], k/v [b,g,sk,d]) -> out [b,h,sq,d], lse [b,h,sq] ---------------------
def _allowed(sq: int, sk: int, causal: bool, doc_mask: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """[b or 1, 1, 1, sq, sk] bool, True = may attend (None: everything)."""
    allowed = None
    if causal:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device).tril()[None, None, None]
    if doc_mask is not None:
        docs = doc_mask[:, None, None]
        allowed = docs if allowed is None else allowed & docs
    return allowed


def _scores(q, k, causal, doc_mask, scale):
    b, h, sq, d = q.shape
    g = k.size(1)
    s = torch.einsum("bgrqd,bgkd->bgrqk", q.float().view(b, g, h // g, sq, d), k.float()) * scale
    allowed = _allowed(sq, k.size(2), causal, doc_mask, q.device)
    return s if allowed is None else s.masked_fill(~allowed, NEG_INF)


def math_forward(q, k, v, causal: bool, doc_mask, scale: float):
    """Attention of one block in fp32; rows with no allowed key give output 0 and LSE -inf."""
    b, h, sq, d = q.shape
    s = _scores(q, k, causal, doc_mask, scale)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    out = torch.einsum("bgrqk,bgkd->bgrqd", p, v.float()) / den.clamp(min=torch.finfo(torch.float32).tiny)
    lse = (m + torch.log(den)).squeeze(-1)
    return out.reshape(b, h, sq, d), lse.reshape(b, h, sq), None


def math_backward(dout, q, k, v, out, lse, causal: bool, doc_mask, scale: float, aux=None):
    """dQ, dK, dV (fp32) of one block, from the final output and LSE of the rows."""
    b, h, sq, d = q.shape
    g = k.size(1)
    view = (b, g, h // g, sq, d)
    p = torch.exp(_scores(q, k, causal, doc_mask, scale) - lse.float().view(b, g, h // g, sq, 1))
    do = dout.float().view(view)
    dv = torch.einsum("bgrqk,bgrqd->bgkd", p, do)
    dp = torch.einsum("bgrqd,bgkd->bgrqk", do, v.float())
    delta = (do * out.float().view(view)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bgrqk,bgkd->bgrqd", ds, k.float()).reshape(b, h, sq, d)
    dk = torch.einsum("bgrqk,bgrqd->bgkd", ds, q.float().view(view))
    return dq, dk, dv


def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    r = heads // k.size(1)
    return k if r == 1 else k.repeat_interleave(r, dim=1)


def _fold(dk: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = dk.shape
    return dk if h == groups else dk.view(b, groups, h // groups, s, d).sum(2)


def flash_forward(q, k, v, causal: bool, doc_mask, scale: float):
    """``aux``: what the backward op takes besides the tensors (the sequence-offset and RNG-state
    outputs of the forward op; unused without dropout or variable lengths, passed back as given)."""
    h = q.size(1)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, _expand(k, h), _expand(v, h), 0.0, causal, False,
                                                             scale=scale)
    return res[0], res[1], (res[2], res[3], res[6], res[7])


def flash_backward(dout, q, k, v, out, lse, causal: bool, doc_mask, scale: float, aux=None):
    h, g = q.size(1), k.size(1)
    cum_q, cum_k, seed, offset = aux
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, _expand(k, h), _expand(v, h), out, lse.contiguous(), cum_q, cum_k, q.size(2), k.size(2), 0.0, causal,
        seed, offset, scale=scale)
    return dq, _fold(dk, g), _fold(dv, g)


def _additive_mask(causal: bool, doc_mask, q: torch.Tensor, sk: int, align: int = 1) -> torch.Tensor:
    """[b, 1, sq, sk] in q's dtype: 0 where a query may attend, masked_value elsewhere. ``align``: the last
    dimension's storage is padded to a multiple of it (the memory-efficient kernel's alignment)."""
    allowed = doc_mask[:, None]
    if causal:
        allowed = allowed & torch.ones(q.size(2), sk, dtype=torch.bool, device=q.device).tril()
    width = -(-sk // align) * align
    bias = torch.zeros(*allowed.shape[:-1], width, dtype=q.dtype, device=q.device)[..., :sk]
    return bias.masked_fill_(~allowed, masked_value(q.dtype))


def _no_key_rows(out, lse, bias):
    """Rows without an allowed key: output 0 and LSE -inf (what the merge expects)."""
    empty = (bias < masked_value(bias.dtype) / 2).all(-1)
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, NEG_INF)


def efficient_forward(q, k, v, causal: bool, doc_mask, scale: float):
    """The memory-efficient kernel with the block's document mask as an additive bias (CUDA)."""
    h, sq = q.size(1), q.size(2)
    bias = _additive_mask(causal, doc_mask, q, k.size(2), align=16)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _expand(k, h), _expand(v, h), bias.expand(-1, h, -1, -1), True, 0.0, False, scale=scale)
    out, lse = _no_key_rows(out, lse[..., :sq], bias)  # (its LSE is padded to a multiple of 32 rows)
    return out, lse, (seed, offset)


def _heads_inner(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] laid out as [b, s, h, d] in memory: the layout the memory-efficient kernel's backward
    reads the output and its gradient in (given [b, h, s, d]-contiguous ones, its dq and dk were off by
    50-100 % on an H100 while dv was right; the diagnosis script is kept in the git history, benchmarks/README.md)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def efficient_backward(dout, q, k, v, out, lse, causal: bool, doc_mask, scale: float, aux=None):
    h, g, sq = q.size(1), k.size(1), q.size(2)
    bias = _additive_mask(causal, doc_mask, q, k.size(2), align=16).expand(-1, h, -1, -1)
    padded = F.pad(lse, (0, -(-sq // 32) * 32 - sq))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _heads_inner(dout), q, _expand(k, h), _expand(v, h), bias, _heads_inner(out), padded.contiguous(), aux[0],
        aux[1], 0.0, [True, True, True, False], False, scale=scale)
    return dq, _fold(dk, g), _fold(dv, g)


def flash_cpu_forward(q, k, v, causal: bool, doc_mask, scale: float):
    """torch's fused CPU kernel with LSE (what the tests run the fused-kernel path of the ring with)."""
    h = q.size(1)
    mask = _additive_mask(causal, doc_mask, q, k.size(2)) if doc_mask is not None else None
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), _expand(k, h).contiguous(), _expand(v, h).contiguous(), 0.0, causal and mask is None,
        attn_mask=mask, scale=scale)
    if mask is not None:
        out, lse = _no_key_rows(out, lse, mask)
    return out, lse, None


def flash_cpu_backward(dout, q, k, v, out, lse, causal: bool, doc_mask, scale: float, aux=None):
    h, g = q.size(1), k.size(1)
    mask = _additive_mask(causal, doc_mask, q, k.size(2)) if doc_mask is not None else None
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q.contiguous(), _expand(k, h).contiguous(), _expand(v, h).contiguous(), out.contiguous(),
        lse.contiguous(), 0.0, causal and mask is None, attn_mask=mask, scale=scale)
    return dq, _fold(dk, g), _fold(dv, g)


class Kernel(NamedTuple):
    name: str
    forward: object
    backward: object


MATH = Kernel("math", math_forward, math_backward)
FLASH = Kernel("flash", flash_forward, flash_backward)
EFFICIENT = Kernel("efficient", efficient_forward, efficient_backward)
KERNELS = {k.name: k for k in (MATH, FLASH, EFFICIENT, Kernel("flash_cpu", flash_cpu_forward, flash_cpu_backward))}


def kernel_for(q: torch.Tensor, masked: bool, name: Optional[str] = None) -> Kernel:
    """On CUDA: flash for bf16/fp16 causal blocks, the memory-efficient kernel for blocks with a
    mask (documents, a sliding window); the fp32 math kernel otherwise (``name`` picks one of KERNELS)."""
    if name is not None:
        return KERNELS[name]
    if q.is_cuda and q.size(-1) % 8 == 0:
        if masked:
            return EFFICIENT
        if q.dtype in (torch.bfloat16, torch.float16):
            return FLASH
    return MATH


# ---- the ring ------------------------------------------------------------------------------------
class Ring(NamedTuple):
    """This rank's place on one context-parallel ring (global ranks, as P2POp wants)."""
    group: object
    rank: int  # index on the ring
    size: int
    next: int
    prev: int

    def exchange(self, t: torch.Tensor, tag: int):
        """Send ``t`` to the next rank, receive the same shape from the previous one: (buffer, works)."""
        recv = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(pending):
    buf, works = pending
    for w in works:
        w.wait()
    return buf


def _chunk_ranges(rank: int, size: int, chunk: int, part: slice) -> list:
    """[start, end) of the global positions in ``part`` of rank ``rank``'s two chunks."""
    ranges = [(rank * chunk, (rank + 1) * chunk), ((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)]
    return ranges[1:] if part.start == chunk else ranges[:1] if part.stop == chunk else ranges


def _block_empty(window, ring: Ring, src: int, blk: Block, chunk: int) -> bool:
    """Whether no query of the block may attend to any of its keys under the sliding ``window``
    (left, _): no q in the rows and k in the columns with q - left <= k <= q. Decided from the chunk
    positions alone (no device work): such blocks are skipped, forward and backward."""
    if window is None:
        return False
    left = window[0]
    return not any(max(k0, q0) <= min(k1 - 1 + left, q1 - 1)
                   for q0, q1 in _chunk_ranges(ring.rank, ring.size, chunk, blk.rows)
                   for k0, k1 in _chunk_ranges(src, ring.size, chunk, blk.cols))


def _block_mask(pattern, ring: Ring, src: int, blk: Block, chunk: int, q: torch.Tensor):
    """[b, sq, sk] True where a query may attend a key besides causality: the same document (``docs``)
    and within the sliding window; None when neither applies."""
    docs, window = pattern
    if docs is None and window is None:
        return None
    q_pos = chunk_positions(ring.rank, ring.size, chunk, q.device)[blk.rows]
    k_pos = chunk_positions(src, ring.size, chunk, q.device)[blk.cols]
    mask = None if docs is None else docs[:, q_pos, None] == docs[:, None, k_pos]
    if window is not None:
        band = (k_pos[None, :] >= q_pos[:, None] - window[0])[None]
        mask = band.expand(q.size(0), -1, -1) if mask is None else mask & band
    return mask


def _ring_order(ring: Ring):
    """The K/V block sources in the order every variant visits them: the own block first."""
    return [(ring.rank - step) % ring.size for step in range(ring.size)]


def _attend(q, blocks, ring: Ring, pattern, sink, scale: float, kernel: Kernel):
    """Forward over ``blocks`` ((src, K/V of src) pairs in ``_ring_order``): the merged output in q's
    dtype, the LSE (fp32) and the first block's kernel extra (its backward's ``aux``). ``pattern``:
    (document ids or None, window or None); ``sink``: per-head sink logits or None, merged last as a
    block whose output is zero and whose LSE is the logit."""
    chunk = q.size(2) // 2
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], NEG_INF, dtype=torch.float32, device=q.device)
    aux = None
    for step, (src, kv) in enumerate(blocks):
        blk = block_plan(ring.rank, src, chunk)
        if _block_empty(pattern[1], ring, src, blk, chunk):  # never the own block (step 0)
            continue
        o, l, extra = kernel.forward(q[:, :, blk.rows], kv[0][:, :, blk.cols], kv[1][:, :, blk.cols], blk.causal,
                                     _block_mask(pattern, ring, src, blk, chunk, q), scale)
        aux = extra if step == 0 else aux
        _merge(out[:, :, blk.rows], lse[:, :, blk.rows], o, l.float(), first=step == 0)
    if sink is not None:
        _merge(out, lse, torch.zeros((), device=q.device), sink.float()[None, :, None].expand_as(lse), first=False)
    return out.to(q.dtype), lse, aux


def _block_grads(ctx, saved, dout, kv, src: int, dq: torch.Tensor):
    """One block's backward (from ``saved``, the forward's saved tensors: the final output and LSE):
    adds its dQ into ``dq`` and returns the block, dK and dV (fp32) of the block's key columns (None
    for a block the window skips)."""
    q, _, _, out, lse, docs, _ = saved
    chunk = q.size(2) // 2
    blk = block_plan(ctx.ring.rank, src, chunk)
    if _block_empty(ctx.window, ctx.ring, src, blk, chunk):
        return blk, None, None
    r, c = blk.rows, blk.cols
    mask = _block_mask((docs, ctx.window), ctx.ring, src, blk, chunk, q)
    dq_b, dk_b, dv_b = ctx.kernel.backward(dout[:, :, r], q[:, :, r], kv[0][:, :, c], kv[1][:, :, c], out[:, :, r],
                                           lse[:, :, r], blk.causal, mask, ctx.scale, ctx.aux)
    dq[:, :, r] += dq_b
    return blk, dk_b, dv_b


def _sink_grad(saved, dout) -> Optional[torch.Tensor]:
    """d loss / d sink logit per head: -sum over rows of p_sink * rowsum(dO * O)."""
    _, _, _, out, lse, _, sink = saved
    if sink is None:
        return None
    delta = (dout.float() * out.float()).sum(-1)
    return -(torch.exp(sink.float()[None, :, None] - lse) * delta).sum((0, 2)).to(sink.dtype)


def _save(ctx, q, k, v, out, lse, pattern, sink, ring, scale, kernel, aux) -> None:
    ctx.save_for_backward(q, k, v, out, lse, pattern[0], sink)
    ctx.ring, ctx.scale, ctx.kernel, ctx.aux, ctx.window = ring, scale, kernel, aux, pattern[1]


class RingAttention(torch.autograd.Function):
    """out = causal attention of this rank's queries over the whole sequence's keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, sink, ring: Ring, docs: Optional[torch.Tensor], scale: float,
                kernel_name: Optional[str], window):
        kernel = kernel_for(q, docs is not None or window is not None, kernel_name)

        def blocks(kv):  # each block's send to the next rank runs while the block is attended
            for step, src in enumerate(_ring_order(ring)):
                pending = ring.exchange(kv, 1) if step < ring.size - 1 else None
                yield src, kv
                if pending is not None:
                    kv = _wait(pending)

        out, lse, aux = _attend(q, blocks(torch.stack([k, v]).contiguous()), ring, (docs, window), sink, scale, kernel)
        _save(ctx, q, k, v, out, lse, (docs, window), sink, ring, scale, kernel, aux)
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # unpacked once (activation recomputation allows no second unpack)
        q, k, v = saved[:3]
        ring = ctx.ring
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        grads = None  # the dK/dV accumulator on its way from the previous rank
        for step, src in enumerate(_ring_order(ring)):
            pending = ring.exchange(kv, 1) if step < ring.size - 1 else None
            blk, dk_b, dv_b = _block_grads(ctx, saved, dout, kv, src, dq)
            if grads is not None:
                dkv = _wait(grads)
            if dk_b is not None:
                dkv[0][:, :, blk.cols] += dk_b
                dkv[1][:, :, blk.cols] += dv_b
            grads = ring.exchange(dkv, 2)  # on to the next rank (after the last step: home)
            if pending is not None:
                kv = _wait(pending)
        dkv = _wait(grads)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), _sink_grad(saved, dout),
                None, None, None, None, None)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Every CP rank's K/V: [CP, 2, b, g, 2c, d] (rank order)."""
    kv = torch.stack([k, v]).contiguous()
    out = torch.empty((ring.size * 2,) + tuple(kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    all_gather_single(out, kv, group=ring.group)
    return out.view((ring.size,) + tuple(kv.shape))


class AllGatherAttention(torch.autograd.Function):
    """RingAttention's block pairs, kernels and merge order, with every rank's K/V gathered at once
    (``--cp-comm-type allgather``) instead of passed around the ring, and again in the backward (nothing
    of the other ranks is kept in between); each rank's dK/dV of every block go home in one
    reduce-scatter (fp32, summed over the ranks)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, ring: Ring, docs: Optional[torch.Tensor], scale: float,
                kernel_name: Optional[str], window):
        kernel = kernel_for(q, docs is not None or window is not None, kernel_name)
        kv = _gather_kv(k, v, ring)
        out, lse, aux = _attend(q, ((src, kv[src]) for src in _ring_order(ring)), ring, (docs, window), sink,
                                scale, kernel)
        _save(ctx, q, k, v, out, lse, (docs, window), sink, ring, scale, kernel, aux)
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        dout = dout.contiguous()
        kv = _gather_kv(k, v, ctx.ring)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for src in _ring_order(ctx.ring):
            blk, dk_b, dv_b = _block_grads(ctx, saved, dout, kv[src], src, dq)
            if dk_b is not None:
                dkv[src, 0][:, :, blk.cols] += dk_b
                dkv[src, 1][:, :, blk.cols] += dv_b
        mine = torch.empty(dkv.shape[1:], dtype=torch.float32, device=q.device)
        reduce_scatter_single(mine, dkv.view((-1,) + tuple(dkv.shape[2:])), group=ctx.ring.group)
        return (dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), _sink_grad(saved, dout),
                None, None, None, None, None)


def _merge(out, lse, o, l, first: bool) -> None:
    """Fold a block's (o, l) into the running (out, lse) views, in place."""
    if first:
        out.copy_(o)
        lse.copy_(l)
        return
    new = torch.logaddexp(lse, l)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o.float() * torch.exp(l - new).unsqueeze(-1))
    lse.copy_(new)


def ring_attention(q, k, v, ring: Ring, docs: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                   kernel: Optional[str] = None, window=None, sink: Optional[torch.Tensor] = None):
    """q [b, heads, 2c, d], k/v [b, groups, 2c, d] (this rank's two chunks), ``docs`` [b, s] the
    document ids of the whole sequence or None: the attention output [b, heads, 2c, d]. ``kernel``:
    a name of KERNELS, else chosen by ``kernel_for``. ``window`` (left, right): a sliding window
    (blocks wholly outside it are skipped); ``sink`` [heads]: attention-sink logits."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, sink, ring, docs, scale, kernel, window)


def allgather_attention(q, k, v, ring: Ring, docs: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                        kernel: Optional[str] = None, window=None, sink: Optional[torch.Tensor] = None):
    """``ring_attention``'s contract (the same blocks, kernels and merge order: equal outputs), with
    K/V all-gathered over ``ring.group`` instead of passed around it."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    return AllGatherAttention.apply(q, k, v, sink, ring, docs, scale, kernel, window)

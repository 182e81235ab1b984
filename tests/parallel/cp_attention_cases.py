"""Rank functions of test_context_parallel.py: ring (p2p), Ulysses (a2a), all-gather and hierarchical
(a2a+p2p) attention against full attention on one rank, forward and backward, causal and packed-document
masks, a sliding window (whose far blocks the ring skips) and attention sinks, with GQA."""
from __future__ import annotations

import dataclasses

import torch

from paratron.parallel.context import ContextParallel, document_causal_mask, merge_sequence, split_sequence
from paratron.parallel.dims import initialize_model_parallel


KINDS = ("p2p", "a2a", "allgather", "p2p_flash_cpu", "allgather_flash_cpu", "a2a+p2p")  # a2a+p2p: CP 4 as 2 x 2


def inputs(seed: int, b=2, h=4, g=2, s=32, d=8):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for n in (h, g, g, h))
    docs = torch.cumsum((torch.rand(b, s, generator=gen) < 0.15).long(), 1)  # packed documents
    return q, k, v, dout, docs


def full_attention(q, k, v, dout, docs, window=None, sink=None):
    """The one-rank reference, written out: scores, the causal / document / window mask, a sink column
    per head, softmax, values; output and the gradients of q, k, v (and the sink logits)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if sink is not None else [])
    q, k, v = leaves[:3]
    b, h, s, d = q.shape
    keys, values = (t.repeat_interleave(h // t.size(1), dim=1) for t in (k, v))
    scores = q @ keys.transpose(-1, -2) / d ** 0.5
    pos = torch.arange(s)
    allowed = (pos[None, :] <= pos[:, None])[None, None]
    if docs is not None:
        allowed = allowed & document_causal_mask(docs)
    if window is not None:
        allowed = allowed & (pos[None, :] >= pos[:, None] - window[0])
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        scores = torch.cat([leaves[3].to(scores.dtype).view(1, h, 1, 1).expand(b, h, s, 1), scores], dim=-1)
        values = torch.cat([values.new_zeros(b, h, 1, d), values], dim=2)
    out = torch.softmax(scores, dim=-1) @ values
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def cp_attention(cp: ContextParallel, q, k, v, dout, docs, window=None, sink=None):
    """This rank's shard through cp.attention; the whole-sequence results merged from every rank (the
    sink's gradient summed over them: each holds its rows' part)."""
    local = [split_sequence(t, cp.size, cp.rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    sink = sink.clone().requires_grad_() if sink is not None else None
    out = cp.attention(*local, docs, window=window, sink=sink)
    out.backward(split_sequence(dout, cp.size, cp.rank, dim=2))
    results = []
    for t in (out.detach(), *(x.grad for x in local)):
        parts = [torch.empty_like(t) for _ in range(cp.size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=cp.group)
        results.append(merge_sequence(parts, dim=2))
    if sink is not None:
        torch.distributed.all_reduce(sink.grad, group=cp.group)
        results.append(sink.grad)
    return results


WINDOW = (5, 0)
MASKS = {"causal": (False, None, False), "documents": (True, None, False), "window": (False, WINDOW, False),
         "window_documents_sinks": (True, WINDOW, True)}  # name: (documents, window, sinks)


def attention_cases(rank: int, world: int) -> dict:
    """Every CP size and comm type that ``world`` ranks allow; returns the largest relative error."""
    errors = {}
    for cp_size in (2, 4):
        if world % cp_size:
            continue
        dims = initialize_model_parallel(context_parallel_size=cp_size)
        for kind in KINDS:
            flash = kind.endswith("_flash_cpu")
            if kind == "a2a+p2p":
                if cp_size != 4:
                    continue
                dims = initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
            cp = ContextParallel.from_dims(dims, kind.removesuffix("_flash_cpu"))
            if flash:  # the ring's blocks with torch's fused kernel (LSE in and out, as flash on GPU)
                cp = dataclasses.replace(cp, kernel="flash_cpu")
            for name, (use_docs, window, sinks) in MASKS.items():
                q, k, v, dout, docs = inputs(seed=cp_size)
                if flash:
                    q, k, v, dout = (t.float() for t in (q, k, v, dout))
                docs = docs if use_docs else None
                sink = torch.linspace(-1.0, 2.0, q.size(1), dtype=q.dtype) if sinks else None
                want = full_attention(q, k, v, dout, docs, window, sink)
                got = cp_attention(cp, q, k, v, dout, docs, window, sink)
                errors[(cp_size, kind, name)] = max(((a - b).norm() / a.norm()).item() for a, b in zip(want, got))
    return errors

"""Rank functions of test_context_parallel.py: ring (p2p), Ulysses (a2a), all-gather and hierarchical
(a2a+p2p) attention against full attention on one rank, forward and backward, causal and packed-document masks, with GQA."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from paratron.parallel.context import ContextParallel, document_causal_mask, merge_sequence, split_sequence
from paratron.parallel.dims import initialize_model_parallel


KINDS = ("p2p", "a2a", "allgather", "p2p_flash_cpu", "allgather_flash_cpu", "a2a+p2p")  # a2a+p2p: CP 4 as 2 x 2


def inputs(seed: int, b=2, h=4, g=2, s=32, d=8):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for n in (h, g, g, h))
    docs = torch.cumsum((torch.rand(b, s, generator=gen) < 0.15).long(), 1)  # packed documents
    return q, k, v, dout, docs


def full_attention(q, k, v, dout, docs):
    """The one-rank reference: output and input gradients of plain attention over the whole sequence."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = document_causal_mask(docs) if docs is not None else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def cp_attention(cp: ContextParallel, q, k, v, dout, docs):
    """This rank's shard through cp.attention; the whole-sequence results merged from every rank."""
    local = [split_sequence(t, cp.size, cp.rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = cp.attention(*local, docs)
    out.backward(split_sequence(dout, cp.size, cp.rank, dim=2))
    results = []
    for t in (out.detach(), *(x.grad for x in local)):
        parts = [torch.empty_like(t) for _ in range(cp.size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=cp.group)
        results.append(merge_sequence(parts, dim=2))
    return results


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
            for name, use_docs in (("causal", False), ("documents", True)):
                q, k, v, dout, docs = inputs(seed=cp_size)
                if flash:
                    q, k, v, dout = (t.float() for t in (q, k, v, dout))
                docs = docs if use_docs else None
                want = full_attention(q, k, v, dout, docs)
                got = cp_attention(cp, q, k, v, dout, docs)
                errors[(cp_size, kind, name)] = max(((a - b).norm() / a.norm()).item() for a, b in zip(want, got))
    return errors

"""Packed documents with a state each, in plain torch: Mamba-2's scan and the gated delta rule over one packed
sequence of documents given by ``cu_seqlens`` ([documents + 1] offsets, 0 ... total: document i is positions
cu[i]:cu[i + 1], at least one each), every document starting from its own initial state (a row of ``state``
[documents, ...]; None: zeros) and returning its own final state ([documents, ...]). This is what the paged
engine's packed prompt chunks need (several requests in one pass, each going on from its state row), and what
flash-linear-attention's variable-length kernels take (kernels/linear_scan.py); the short convolution's packed
form is kernels/causal_conv.py's ``causal_conv_varlen``.

The references lay the documents out chunk-aligned in one row (:func:`chunk_aligned`: each document starts a
chunk and is padded to whole chunks; the padding is no input with decay 1, so it changes no state) and run the
chunked scans (kernels/ssd.py, kernels/gated_delta.py), whose chunk loop takes each document's initial state at
its first chunk and keeps its state after its last (``DocStates``). A document's numbers are then those of its
own chunked scan alone: the chunks are the same. Shapes as the chunked scans', batch 1: x [1, total, h, p] ...
"""
from __future__ import annotations

from typing import Optional

import torch

from .gated_delta import gated_delta_chunked
from .ssd import ssd_chunked


def host_to(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait: to a GPU through pinned memory, queued behind the
    work already there (a copy of pageable memory waits for the device's queue to drain, a host synchronisation)."""
    if torch.device(device).type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    if torch.cuda.is_current_stream_capturing():  # a graph would replay the copy from a freed pinned buffer
        raise RuntimeError("host values reach a captured CUDA graph only through a device tensor filled before "
                           "each replay; pass the offsets on the device")
    return host.pin_memory().to(device, non_blocking=True)


def lengths_of(cu_seqlens: torch.Tensor) -> list[int]:
    """The documents' lengths (host ints) of ``cu_seqlens``; each must hold a token."""
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if cu[0] != 0 or not lengths or min(lengths) < 1:
        raise ValueError(f"cu_seqlens must start at 0 and give every document a token, got {cu}")
    return lengths


def chunk_aligned(lengths: list[int], q: int, device=None) -> tuple[torch.Tensor, list[int], int]:
    """(each packed position's place in the chunk-aligned row [total], the chunk each document starts, the row's
    length): document i starts at a multiple of ``q`` and takes whole chunks."""
    index, starts, at = [], [], 0
    for n in lengths:
        starts.append(at // q)
        index.extend(range(at, at + n))
        at += -(-n // q) * q
    return host_to(torch.tensor(index), device or "cpu"), starts, at


def spread(t: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    """[1, total, ...] -> [1, length, ...]: the packed positions at ``index``, zeros elsewhere."""
    return t.new_zeros(1, length, *t.shape[2:]).index_copy(1, index, t)


def _layout(cu_seqlens: torch.Tensor, chunk_size: int, device):
    lengths = lengths_of(cu_seqlens)
    q = min(chunk_size, max(lengths))  # (short documents are not padded to a long chunk)
    index, starts, length = chunk_aligned(lengths, q, device)
    return q, index, starts, length


def ssd_varlen(x, dt, A, B, C, cu_seqlens: torch.Tensor, state: Optional[torch.Tensor] = None,
               chunk_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [1, total, h, p], final states [documents, h, p, n]) of Mamba-2's scan over packed documents."""
    q, index, starts, length = _layout(cu_seqlens, chunk_size, x.device)
    x, dt, B, C = (spread(t, index, length) for t in (x, dt, B, C))  # padding: dt 0 (decay 1), no input
    y, final = ssd_chunked(x, dt, A, B, C, None, state, q, starts=starts)
    return y.index_select(1, index), final


def gated_delta_varlen(q, k, v, g, beta, cu_seqlens: torch.Tensor, state: Optional[torch.Tensor] = None,
                       scale: Optional[float] = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [1, total, h, dv], final states [documents, h, dk, dv]) of the gated delta rule over packed documents."""
    n, index, starts, length = _layout(cu_seqlens, chunk_size, q.device)
    scale = k.size(-1) ** -0.5 if scale is None else scale
    q, k, v, g, beta = (spread(t, index, length) for t in (q, k, v, g, beta))  # padding: beta 0, g 0: no update
    o, final = gated_delta_chunked(q, k, v, g, beta, None, state, scale, n, starts=starts)
    return o.index_select(1, index), final

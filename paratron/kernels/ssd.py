"""Mamba-2's selective state-space scan (SSD), in plain torch: the sequential recurrence and the chunked form.

Per head h with state S [headdim, state_dim], at each position t of a sequence::

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        y_t = S_t C_t

(x_t [headdim], B_t and C_t [state_dim], shared by the heads of one group; dt_t > 0 after softplus; A_h < 0).
The D skip (``y + D x``) and the gate are the mixer's (paratron/model/mamba.py).

``reset`` [b, s] (packed documents, ``--reset-attention-mask`` data): True where a new document starts; the
state carried into that position is dropped, so no document sees another's tokens.

:func:`ssd_sequential` is the recurrence as written, one position at a time (the definition tests trust).
:func:`ssd_chunked` is the same sum regrouped over chunks of ``chunk_size`` positions: within a chunk an
attention-like masked product (:func:`chunk_decays` builds the decay matrix), between chunks the state carried
by a short loop. It is the CPU path of training and the reference a fused GPU kernel is tested against. The
GPU path (switch ``--kernel-linear-scan``) is flash-linear-attention's chunked Triton kernels
(paratron/kernels/linear_scan.py).

Shapes are batch-first: x [b, s, h, p], dt [b, s, h], A [h], B and C [b, s, g, n], state [b, h, p, n].
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """[b, s, g, n] per group -> [b, s, h, n] per head (the heads of a group are contiguous)."""
    return t.repeat_interleave(h // t.size(2), dim=2)


def ssd_sequential(x, dt, A, B, C, reset: Optional[torch.Tensor] = None,
                   state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [b, s, h, p], final state [b, h, p, n]) of the recurrence, one position at a time."""
    b, s, h, p = x.shape
    Bh, Ch = _heads(B, h), _heads(C, h)
    S = state if state is not None else x.new_zeros(b, h, p, B.size(-1))
    ys = []
    for t in range(s):
        decay = torch.exp(dt[:, t] * A)  # [b, h]
        if reset is not None:
            decay = decay * (~reset[:, t]).to(decay.dtype)[:, None]
        S = decay[..., None, None] * S + torch.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], Bh[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
    return torch.stack(ys, dim=1), S


def _chunks(t: torch.Tensor, q: int, value=0) -> torch.Tensor:
    """[b, s, ...] -> [b, c, q, ...], the sequence padded at its end to whole chunks."""
    pad = (-t.size(1)) % q
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad), value=value)
    return t.view(t.size(0), t.size(1) // q, q, *t.shape[2:])


def chunk_decays(a: torch.Tensor, reset: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decays of one chunked pass, from the log-decays ``a`` [b, c, q, h] (<= 0) and the document starts
    ``reset`` [b, c, q] (or None).

    Returns ``L`` [b, c, q, q, h]: L[i, j] = exp(a_{j+1} + ... + a_i) for j <= i when no document starts in
    (j, i], else 0 (what position j's input weighs at position i); and ``start`` [b, c, q, h]: exp(a_1 + ... +
    a_i) when no document starts in [1, i], else 0 (what the state carried into the chunk weighs at i)."""
    cum = a.cumsum(2)
    q = a.size(2)
    ok = torch.ones(q, q, dtype=torch.bool, device=a.device).tril()
    start_ok = torch.ones_like(cum, dtype=torch.bool)
    if reset is not None:
        seg = reset.long().cumsum(2)  # documents begun within the chunk up to each position
        ok = ok & (seg[:, :, :, None] == seg[:, :, None, :])
        start_ok = (seg == 0)[..., None].expand_as(cum)
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]
    L = torch.where(ok[..., None].expand_as(diff), diff, float("-inf")).exp()
    start = torch.where(start_ok, cum, float("-inf")).exp()
    return L, start


class DocStates:
    """The documents of one packed row laid out chunk-aligned (kernels/varlen.py: each starts a chunk):
    ``starts`` the chunks that begin a document (ascending, the first 0), ``init`` [documents, ...] each one's
    initial state (None: zeros). The chunked scans ask ``enter`` for the state entering each chunk and hand
    ``leave`` the state after it; ``finals`` [documents, ...] are the states after each document's last chunk."""

    def __init__(self, starts: list, init: Optional[torch.Tensor], chunks: int):
        self.first = {c: i for i, c in enumerate(starts)}
        self.last = {c: i for i, c in enumerate([c - 1 for c in starts[1:]] + [chunks - 1])}
        self.init, self.out = init, [None] * len(starts)

    def enter(self, c: int, S: torch.Tensor) -> torch.Tensor:
        i = self.first.get(c)
        if i is None:
            return S
        return torch.zeros_like(S) if self.init is None else self.init[i:i + 1].to(S.dtype)

    def leave(self, c: int, S: torch.Tensor) -> None:
        if c in self.last:
            self.out[self.last[c]] = S

    def finals(self) -> torch.Tensor:
        return torch.cat(self.out)


def ssd_chunked(x, dt, A, B, C, reset: Optional[torch.Tensor] = None, state: Optional[torch.Tensor] = None,
                chunk_size: int = 128, starts: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [b, s, h, p], final state [b, h, p, n]) of the recurrence, computed chunk by chunk. ``starts``: a packed
    row (b = 1) of chunk-aligned documents (:class:`DocStates`; ``state`` and the final state are then
    [documents, h, p, n])."""
    b, s, h, p = x.shape
    q = min(chunk_size, s)
    xdt = _chunks(x * dt[..., None], q)  # padding: no input, decay 1 (the final state is unchanged)
    Bh, Ch = _chunks(_heads(B, h), q), _chunks(_heads(C, h), q)
    L, start = chunk_decays(_chunks(dt * A, q), None if reset is None else _chunks(reset, q, False))
    # within each chunk: y_i = sum_j (C_i . B_j) L[i, j] dt_j x_j
    y = torch.einsum("bcijh,bcjhp->bcihp", torch.einsum("bcihn,bcjhn->bcijh", Ch, Bh) * L, xdt)
    # each chunk's own contribution to the state at its end (L's last row: decay from j to the end)
    local = torch.einsum("bcjh,bcjhn,bcjhp->bchpn", L[:, :, -1], Bh, xdt)
    docs = None if starts is None else DocStates(starts, state, xdt.size(1))
    S = state if state is not None and docs is None else x.new_zeros(b, h, p, B.size(-1))
    carried = []
    for c in range(xdt.size(1)):  # between chunks: the state carried over each boundary
        S = S if docs is None else docs.enter(c, S)
        carried.append(S)
        S = start[:, c, -1, :, None, None] * S + local[:, c]
        if docs is not None:
            docs.leave(c, S)
    carried = torch.stack(carried, dim=1)  # [b, c, h, p, n]: the state entering each chunk
    y = y + torch.einsum("bcihn,bchpn,bcih->bcihp", Ch, carried, start)
    return y.reshape(b, -1, h, p)[:, :s], S if docs is None else docs.finals()


def resets_of(document_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``document_ids`` [b, s] (packed documents) -> [b, s] bool, True where a document starts after the first
    position (the first position has nothing before it to forget); None stays None."""
    if document_ids is None:
        return None
    out = torch.zeros_like(document_ids, dtype=torch.bool)
    out[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return out

"""The gated delta rule of Gated DeltaNet (Qwen3-Next's linear attention), in plain torch: the sequential
recurrence and the chunked form.

Per head with state S [key_dim, value_dim], at each position t (q_t, k_t L2-normalised by the mixer; beta_t in
(0, 1); g_t <= 0 the log-decay)::

    S'  = exp(g_t) S_{t-1}
    S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T        o_t = S_t^T q_t * scale

``reset`` [b, s]: True where a packed document starts (the carried state is dropped there).

:func:`gated_delta_chunked` regroups the sum over chunks: with G the within-chunk cumulative log-decay and
S_0 the state entering a chunk, the updates u_i = beta_i (v_i - S'_i^T k_i) solve a unit lower-triangular
system (I + M) U = beta V - beta exp(G) K S_0 with M_ij = beta_i exp(G_i - G_j) k_i . k_j (j < i, same
document), after which O = exp(G) Q S_0 + (Q K^T * decay) U and S_end = exp(G_last) S_0 + (K * decay to
the end)^T U. The decays (and the document masks inside them) are Mamba-2's (kernels/ssd.py chunk_decays).

Shapes are batch-first: q, k [b, s, h, dk], v [b, s, h, dv], g and beta [b, s, h], state [b, h, dk, dv].
"""
from __future__ import annotations

from typing import Optional

import torch

from .ssd import DocStates, _chunks, chunk_decays


def gated_delta_sequential(q, k, v, g, beta, reset: Optional[torch.Tensor] = None,
                           state: Optional[torch.Tensor] = None,
                           scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [b, s, h, dv], final state [b, h, dk, dv]) of the recurrence, one position at a time."""
    b, s, h, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    S = state if state is not None else v.new_zeros(b, h, dk, v.size(-1))
    out = []
    for t in range(s):
        decay = g[:, t].exp()
        if reset is not None:
            decay = decay * (~reset[:, t]).to(decay.dtype)[:, None]
        S = decay[..., None, None] * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    return torch.stack(out, dim=1), S


def gated_delta_chunked(q, k, v, g, beta, reset: Optional[torch.Tensor] = None,
                        state: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                        chunk_size: int = 64, starts: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [b, s, h, dv], final state [b, h, dk, dv]) of the recurrence, computed chunk by chunk; ``starts`` as
    kernels/ssd.py's ``ssd_chunked`` (chunk-aligned packed documents, a state each)."""
    b, s, h, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    n = min(chunk_size, s)
    # padding: zero keys and beta (no update), decay 1 (the final state is unchanged)
    qc, kc, vc = (_chunks(t, n).transpose(2, 3) for t in (q * scale, k, v))  # [b, c, h, n, d]
    L, start = chunk_decays(_chunks(g, n), None if reset is None else _chunks(reset, n, False))
    L, start = L.permute(0, 1, 4, 2, 3), start.transpose(2, 3)  # [b, c, h, n, n], [b, c, h, n]
    bc = _chunks(beta, n).transpose(2, 3)[..., None]  # [b, c, h, n, 1]
    eye = torch.eye(n, dtype=k.dtype, device=k.device)
    strict = L * (1 - eye)
    system = eye + bc * (kc @ kc.transpose(-1, -2)) * strict  # I + M, unit lower triangular
    u0 = torch.linalg.solve_triangular(system, bc * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, bc * start[..., None] * kc, upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * L
    to_end = L[..., -1, :, None]  # [b, c, h, n, 1]: decay from each position to the chunk's end
    docs = None if starts is None else DocStates(starts, state, kc.size(1))
    S = state if state is not None and docs is None else v.new_zeros(b, h, dk, v.size(-1))
    out = []
    for c in range(kc.size(1)):
        S = S if docs is None else docs.enter(c, S)
        u = u0[:, c] - w[:, c] @ S  # the updates given the state entering the chunk
        out.append((start[:, c, :, :, None] * qc[:, c]) @ S + attn[:, c] @ u)
        S = start[:, c, :, -1, None, None] * S + (kc[:, c] * to_end[:, c]).transpose(-1, -2) @ u
        if docs is not None:
            docs.leave(c, S)
    o = torch.stack(out, dim=1).transpose(2, 3)  # [b, c, n, h, dv]
    return o.reshape(b, -1, h, v.size(-1))[:, :s], S if docs is None else docs.finals()

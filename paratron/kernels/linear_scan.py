"""The scans of Mamba-2 (SSD) and Gated DeltaNet, by the ``--kernel-linear-scan`` switch: ``torch`` runs the
chunked references (kernels/ssd.py, kernels/gated_delta.py; one step of the recurrence when decoding a
token), ``fla`` flash-linear-attention's chunked Triton kernels (the pure-Python wheel ``fla-core``, on CUDA;
docs/design.md says why this library). Packed documents reach fla as variable-length sequences (cu_seqlens over
the flattened batch; a row's state starts its first document and its last document's is the row's final
state); the references take the resets themselves. With ``cu_seqlens`` (one packed row of documents, a state
each: the paged engine's prompt chunks) both take the documents as they are: fla's variable-length kernels with
a row of initial and final states per document, the references of kernels/varlen.py. Shapes as
kernels/ssd.py."""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .gated_delta import gated_delta_chunked, gated_delta_sequential
from .ssd import _heads, ssd_chunked, ssd_sequential
from .varlen import gated_delta_varlen, ssd_varlen


FLA_BAD_TRITON = ((3, 4, 0), (3, 7, 1))  # fla-core's own check (its issue #640): wrong gated backward on Hopper


def _version(text: str) -> tuple:
    return tuple(int(p) for p in (text.split("+")[0].split(".") + ["0", "0"])[:3] if p.isdigit())


def fla_refusal() -> Optional[str]:
    """Why fla-core's kernels cannot train here, or None. fla-core 0.6 itself refuses its gated backward
    (both scans use it) on Hopper with Triton in [3.4.0, 3.7.1) unless tilelang is installed: that Triton
    compiles it to wrong results (fla-core issue #640). torch 2.11 ships Triton 3.6."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return None
    if importlib.util.find_spec("tilelang") is not None or importlib.util.find_spec("triton") is None:
        return None
    import triton
    low, high = FLA_BAD_TRITON
    if low <= _version(triton.__version__) < high:
        return (f"fla-core's gated backward is wrong with Triton {triton.__version__} on Hopper (fla-core issue "
                "#640): install Triton >= 3.7.1 or tilelang, or use --kernel-linear-scan torch")
    return None


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_usable() -> bool:
    """fla-core importable and no known fault of it with this Triton on this GPU (``fla_refusal``)."""
    return fla_installed() and fla_refusal() is None


def fla_available(device) -> bool:
    """``fla_usable`` on a CUDA device (fla-core's kernels are Triton kernels for GPUs)."""
    return torch.device(device or "cpu").type == "cuda" and fla_usable()


def _cu_seqlens(reset: torch.Tensor) -> torch.Tensor:
    """The start of every document of the flattened batch [b * s] (rows start documents too), and its end."""
    b, s = reset.shape
    starts = reset.clone()
    starts[:, 0] = True
    idx = starts.flatten().nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([b * s])]).to(torch.int32)


def _varlen(reset: Optional[torch.Tensor], *ts):
    """fla's layout for packed documents: batch 1, each document a sequence of cu_seqlens."""
    if reset is None:
        return None, ts
    return _cu_seqlens(reset), tuple(t.reshape(1, -1, *t.shape[2:]) for t in ts)


def _doc_init(reset, cu: Optional[torch.Tensor], s: int, state: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """fla's initial states of the packed documents: each row's state starts the row's first document (unless
    the row's first position is itself a reset), the documents that start inside a row start from zero."""
    if cu is None or state is None:
        return state
    kept = state * (~reset[:, 0]).to(state.dtype).view(-1, *[1] * (state.dim() - 1))
    first = (cu[:-1] % s == 0).nonzero().flatten()
    return state.new_zeros(cu.numel() - 1, *state.shape[1:]).index_copy(0, first, kept)


def _row_final(cu: Optional[torch.Tensor], s: int, final: torch.Tensor) -> torch.Tensor:
    """Each row's final state from fla's per-document ones: the state of the document that ends the row."""
    return final if cu is None else final.index_select(0, (cu[1:] % s == 0).nonzero().flatten())


def recomputed(fn, *args, recompute: bool = True):
    """``fn(*args)``; with ``recompute`` (and gradients wanted) its backward recomputes ``fn``'s intermediates
    from ``args`` instead of keeping them (torch's non-reentrant checkpoint, which torch.compile traces into the
    layer's graph). For the chunked torch scans: their intra-chunk [chunk x chunk] products dominate a hybrid
    layer's activations, the inputs are a small part (docs/hybrid.md)."""
    wanted = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if not (recompute and wanted):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def ssd(x, dt, A, B, C, reset=None, state=None, chunk_size: int = 128, kernel: str = "torch",
        recompute: bool = False, cu_seqlens: Optional[torch.Tensor] = None):
    """(y [b, s, h, p], final state [b, h, p, n]) of Mamba-2's scan; ``recompute``: the torch scan's
    intermediates recomputed in backward (``recomputed``). ``cu_seqlens``: x [1, total, ...] packs documents
    (kernels/varlen.py), ``state`` and the final state are [documents, h, p, n] (``reset`` unused)."""
    if cu_seqlens is not None:
        return _ssd_packed(x, dt, A, B, C, cu_seqlens, state, chunk_size, kernel)
    if x.size(1) == 1 and state is not None:  # decoding: one step of the recurrence
        return ssd_sequential(x, dt, A, B, C, reset, state)
    if kernel != "fla":
        return recomputed(ssd_chunked, x, dt, A, B, C, reset, state, chunk_size, recompute=recompute)
    from fla.ops.simple_gla import chunk_simple_gla  # simple GLA: a scalar decay per head, as Mamba-2's
    b, s, h, _ = x.shape
    cu, (q, k, v, g) = _varlen(reset, _heads(C, h), _heads(B, h), x * dt[..., None], dt * A)
    init = None if state is None else state.transpose(-1, -2).contiguous()
    y, final = chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=_doc_init(reset, cu, s, init),
                                output_final_state=True, cu_seqlens=cu)
    return y.reshape(b, s, *y.shape[2:]), _row_final(cu, s, final).transpose(-1, -2)


def gated_delta(q, k, v, g, beta, reset=None, state=None, chunk_size: int = 64, kernel: str = "torch",
                scale: Optional[float] = None, recompute: bool = False, cu_seqlens: Optional[torch.Tensor] = None):
    """(o [b, s, h, dv], final state [b, h, dk, dv]) of the gated delta rule (q, k already L2-normalised);
    ``recompute`` and ``cu_seqlens`` as ``ssd``'s."""
    if cu_seqlens is not None:
        return _gated_delta_packed(q, k, v, g, beta, cu_seqlens, state, chunk_size, kernel, scale)
    if q.size(1) == 1 and state is not None:
        return gated_delta_sequential(q, k, v, g, beta, reset, state, scale)
    if kernel != "fla":
        return recomputed(gated_delta_chunked, q, k, v, g, beta, reset, state, scale, chunk_size,
                          recompute=recompute)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    b, s = q.shape[:2]
    cu, (q, k, v, g, beta) = _varlen(reset, q, k, v, g, beta)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=_doc_init(reset, cu, s, state),
                                      output_final_state=True, cu_seqlens=cu)
    return o.reshape(b, s, *o.shape[2:]), _row_final(cu, s, final)


def _ssd_packed(x, dt, A, B, C, cu, state, chunk_size: int, kernel: str):
    """Packed documents with a state each: fla's variable-length scan returns a final state per document."""
    if kernel != "fla":
        return ssd_varlen(x, dt, A, B, C, cu, state, chunk_size)
    from fla.ops.simple_gla import chunk_simple_gla
    h = x.size(2)
    init = None if state is None else state.transpose(-1, -2).contiguous()
    y, final = chunk_simple_gla(_heads(C, h), _heads(B, h), x * dt[..., None], g=dt * A, scale=1.0,
                                initial_state=init, output_final_state=True, cu_seqlens=cu.to(x.device, torch.int32))
    return y, final.transpose(-1, -2)


def _gated_delta_packed(q, k, v, g, beta, cu, state, chunk_size: int, kernel: str, scale: Optional[float]):
    if kernel != "fla":
        return gated_delta_varlen(q, k, v, g, beta, cu, state, scale, chunk_size)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                                  cu_seqlens=cu.to(q.device, torch.int32))

"""The query gradient straight from FlashAttention-4's fp32 accumulator into the QKV gradient (rotary layers).

FlashAttention-4's backward adds dQ up in fp32 (atomics, one accumulator per head) and a postprocess kernel then
converts the accumulator into a bf16 dq; with the rotary embedding the rotation's backward reads that dq again
and writes the QKV gradient's query slots (flash_attention.py, rope_kernels.py). Here, for the duration of one
backward call, FlashAttention-4's conversion of dQ is replaced by ``rope_kernels.unrotate_accum_into_``, which
reads the accumulator once and writes the rotated-back query gradient into its slots: the bf16 dq is neither
written nor read again (two of the five [tokens, hidden] passes of the two kernels; ~2.8 ms per 65,536 tokens
on llama-1b). Its values are those of the postprocess + rotation bit for bit (same scaling, same roundings).

The accumulator's element order inside a tile is the postprocess kernel's own business (its MMA's register
layout). It is learned once per kernel configuration by running that kernel on one tile whose values are their
own indices (in two passes, the low and the high 8 bits, each exact in bf16), and checked to be a permutation.

flash-attn-4 4.0.0b10's ``_flash_attn_bwd`` calls its module function ``_bwd_postprocess_convert`` for dQ first,
then for dK and dV (grouped heads). If a later version does not (the function or its arguments renamed, dQ not
converted first, or the learned order not a permutation), the backward converts dq itself and the caller takes
the unfused path: no wrong gradient, a warning. ``PARATRON_ROPE_DQ=0`` keeps the unfused path.
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import rope_kernels

try:  # optional: flash-attn-4 (Hopper / Blackwell)
    from flash_attn.cute import interface as _fa_iface
except Exception:  # noqa: BLE001 - not installed, or its CUDA libraries do not load on this machine
    _fa_iface = None

ENABLED = os.environ.get("PARATRON_ROPE_DQ", "1") != "0"  # read once, like the other switches
# the conversion's arguments that this module reads or sets; the others (tile, threads, MMA layout) it passes on
_NAMES = {"accum", "output", "scale", "cu_seqlens", "seqused", "hdim", "block_size"}


def _takes(iface) -> bool:
    """``iface`` converts accumulators by a ``_bwd_postprocess_convert`` with the arguments this module uses."""
    convert = getattr(iface, "_bwd_postprocess_convert", None)
    return convert is not None and _NAMES <= set(inspect.signature(convert).parameters)


def applies(q: Tensor) -> bool:
    """The backward of a rotary layer's attention on ``q``'s device takes this path."""
    return ENABLED and q.is_cuda and _fa_iface is not None and _takes(_fa_iface)


@functools.lru_cache(maxsize=None)
def _accum_order(convert, rest: tuple, device: torch.device, dtype: torch.dtype) -> Tensor:
    """perm [T, d] int32: where the postprocess kernel ``convert`` (its other arguments ``rest``, name/value
    pairs) reads element (r, c) of a tile of T rows of the accumulator; learned on one index-coded tile."""
    named = dict(rest)
    tile, hdim = named["block_size"], named["hdim"]
    per_row = -(-hdim // 32) * 32  # the accumulator's rounded head dimension (FlashAttention-4's allocation)
    idx = torch.arange(tile * per_row, device=device, dtype=torch.float32).view(1, 1, -1)
    out = torch.empty(1, tile, 1, hdim, device=device, dtype=dtype)
    parts = []
    for code in (torch.remainder(idx, 256), torch.div(idx, 256, rounding_mode="floor")):
        convert(**named, accum=code.contiguous(), output=out, scale=1.0, cu_seqlens=None, seqused=None)
        parts.append(out.float().view(tile, hdim))
    perm = (parts[1] * 256 + parts[0]).to(torch.int32)
    if perm.unique().numel() != perm.numel() or int(perm.min()) < 0 or int(perm.max()) >= tile * per_row:
        raise RuntimeError("the learned dQ accumulator order is not a permutation of the tile")
    return perm


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
             dk: Tensor, dv: Tensor, dqkv: Tensor, cos: Tensor, sin: Tensor, iface=None) -> Optional[Tensor]:
    """FlashAttention-4's backward of causal attention (q [b, s, heads, d], k / v / dk / dv [b, s, groups, d]
    views) with dq written rotated back into the query slots of dqkv [s, b, groups, q_per_group + 2, d]
    (cos / sin [s, d]); dk and dv as FlashAttention-4 writes them. Returns None when it did so, else (see the
    module's note) dq [s, b, heads, d] for the unfused rotation. ``iface``: flash_attn.cute.interface (tests
    pass a stand-in)."""
    iface = _fa_iface if iface is None else iface
    original = iface._bwd_postprocess_convert
    signature, taken = inspect.signature(original), []

    def convert(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if taken or a["cu_seqlens"] is not None or a["seqused"] is not None or tuple(a["output"].shape) != q.shape:
            return original(*args, **kwargs)  # dK / dV (or not the call this module expects)
        taken.append(False)
        try:
            rest = tuple((n, x) for n, x in a.items() if n not in ("accum", "output", "scale", "cu_seqlens", "seqused"))
            perm = _accum_order(original, rest, q.device, q.dtype)
        except Exception as e:  # noqa: BLE001 - the unfused path then, and say why
            warnings.warn(f"dq from FlashAttention-4's accumulator: {type(e).__name__}: {e}; the unfused path")
            return original(*args, **kwargs)
        rope_kernels.unrotate_accum_into_(dqkv, a["accum"], perm, a["scale"], cos, sin)
        taken[0] = True

    convert.compile_cache = getattr(original, "compile_cache", None)  # the original reads it by its global name
    iface._bwd_postprocess_convert = convert
    try:
        dq = iface._flash_attn_bwd(q, k, v, out, dout, lse, scale, True, dk=dk, dv=dv)[0]
    finally:
        iface._bwd_postprocess_convert = original
    if taken and taken[0]:
        return None
    if not taken:
        warnings.warn("FlashAttention-4 did not convert dQ as flash_dq expects: the unfused path")
    return dq.transpose(0, 1)

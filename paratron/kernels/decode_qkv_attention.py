"""A one-row decode step's QKV projection and its fused attention as one Triton kernel
(``--kernel-decode-attention fused_qkv``).

At batch 1 a layer's attention half is two kernels: the QKV row GEMV (kernels/gemv_row.py: the norm, the product,
the bias) and the fused attention (kernels/decode_rotary.py: rotation, cache write, attention), the second waiting
for the whole of the first. Here the GEMV's programs, each owning ``BLOCK_N`` rows of the QKV output, write their
rows to a scratch row and count themselves in on their key/value group's counter (an atomic add with acquire-release
ordering after a barrier, as the fused attention's splits do); the group's last program to arrive resets the counter
and runs that group's attention over the whole cache (one program a group: ``decode_rotary._group_walk``, then the
new token). A group's attention starts when its own rows are written, and there is one kernel boundary less a layer.
It takes a cache of at most ``decode_rotary.FUSED_SPAN`` slots (one program then walks what the fused attention's
splits would share); a longer cache, or a shape the kernel does not take, runs the two kernels.

Numerics: the GEMV's (the normalised row rounded to the model's dtype, times the norm's weight, rounded; the product
and its bias rounded) and the fused attention's; :func:`reference` is the two references in sequence, what the tests
compare the kernel with (on CPU through Triton's interpreter) and what runs off CUDA.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import decode_rotary, gemv_row
from .hardware import early_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_N = 4  # QKV rows a program (the row GEMV's early-launch shape)


def reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
              bias: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, pad: torch.Tensor, slot: torch.Tensor, scale: float, groups: int,
              norms: Optional[tuple] = None) -> torch.Tensor:
    """The QKV row GEMV of ``x`` [K] (weight [groups x (q_per_group + 2) x d, K], the attention's RMSNorm weight,
    the projection's bias) then the fused attention (``decode_rotary.decode_rotary_reference``): [1, groups,
    q_per_group, d]; the caches written at ``slot``."""
    qkv = gemv_row.row_reference(x.reshape(1, -1), weight, norm_weight, eps=eps, bias=bias)
    qkv = qkv.view(groups, -1, k_cache.size(-1))
    return decode_rotary.decode_rotary_reference(qkv, cos.reshape(-1), sin.reshape(-1), k_cache, v_cache, pad, slot,
                                                 scale, norms)


def applies(x: torch.Tensor, weight: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: int) -> bool:
    """Whether the kernel takes this step: the row GEMV's conditions, the fused attention's shapes, a cache of at
    most FUSED_SPAN slots (one program a group walks it)."""
    rows, d = weight.size(0) // groups, k_cache.size(-1)
    return (gemv_row.applies(x, weight) and weight.size(0) % groups == 0 and rows % d == 0 and rows % BLOCK_N == 0
            and decode_rotary.shapes_supported(x.dtype, rows // d - 2, k_cache, v_cache)
            and k_cache.size(2) <= decode_rotary.FUSED_SPAN)


def decode_qkv_attention(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                         bias: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, pad: torch.Tensor, slot: torch.Tensor, scale: float,
                         counts: torch.Tensor, groups: int, pdl: bool = False,
                         norms: Optional[tuple] = None) -> Optional[torch.Tensor]:
    """:func:`reference` by the kernel on CUDA, or None there where it does not :func:`applies` (the caller then runs
    the two kernels); off CUDA the reference. ``counts``: int32 zeros, one per group at least, kept between calls
    (the KV cache's; the kernel leaves them 0); ``pdl``: launched early (programmatic dependent launch; it waits for
    the kernel before it once its first weight blocks are requested)."""
    if x.is_cuda:
        if not (applies(x, weight, k_cache, v_cache, groups) and counts.numel() >= groups):
            return None
        q_norm, k_norm, qk_eps = norms if norms is not None else (x.new_zeros(0), x.new_zeros(0), 0.0)
        empty = x.new_zeros(0)
        return torch.ops.paratron.decode_qkv_attention(
            x.reshape(1, -1), weight, empty if norm_weight is None else norm_weight, eps,
            empty if bias is None else bias, cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous(), k_cache,
            v_cache, pad, slot, scale, counts, groups, pdl, q_norm.contiguous(), k_norm.contiguous(), qk_eps)
    return reference(x, weight, norm_weight, eps, bias, cos, sin, k_cache, v_cache, pad, slot, scale, groups, norms)


if triton is not None:
    from .decode_rotary import _group_walk, _span, _with_new
    from .gemv_row import _row_values

    @triton.jit
    def _qkv_attention_kernel(x_ptr, w_ptr, g_ptr, b_ptr, qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pad_ptr, slot_ptr,
                              out_ptr, count_ptr, N, K, eps, scale, skg, skt, svg, svt, sog, soh, qn_ptr, kn_ptr,
                              qk_eps, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr,
                              POLICY: tl.constexpr, QPG: tl.constexpr, QB: tl.constexpr, D: tl.constexpr,
                              BT: tl.constexpr, QK_NORM: tl.constexpr):
        """Program i: QKV rows [i BLOCK_N, (i + 1) BLOCK_N) into ``qkv_ptr``; the last of its group's programs to
        arrive runs the group's attention (the module docstring)."""
        pid = tl.program_id(0)
        dt = x_ptr.dtype.element_ty
        rn, n_ok, y = _row_values(x_ptr, w_ptr, g_ptr, x_ptr, b_ptr, N, K, eps, pid, NORM, False, False, PDL,
                                  BLOCK_N, BLOCK_K, HAS_BIAS, AHEAD, POLICY)
        tl.store(qkv_ptr + rn, y.to(dt), mask=n_ok)
        per: tl.constexpr = (QPG + 2) * D // BLOCK_N  # programs a group
        g = pid // per
        tl.debug_barrier()  # every thread's rows stored before the count says so
        if tl.atomic_add(count_ptr + g, 1, sem="acq_rel") == per - 1:
            tl.store(count_ptr + g, 0)
            slot, lo, hi = _span(slot_ptr, pad_ptr, 1, 0, BT)
            q, k_new, v_new, m, total, acc = _group_walk(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pad_ptr, g, 0, 1,
                                                         slot, lo, hi, scale, skg, skt, svg, svt, qn_ptr, kn_ptr,
                                                         qk_eps, QPG, QB, D, BT, QK_NORM)
            _, total, acc = _with_new(q, k_new, v_new, pid >= 0, scale, m, total, acc)  # (the new token: always)
            heads, cols = tl.arange(0, QB), tl.arange(0, D)
            tl.store(out_ptr + g * sog + heads[:, None] * soh + cols[None, :], (acc / total[:, None]).to(dt),
                     mask=(heads < QPG)[:, None])

    @torch.library.custom_op("paratron::decode_qkv_attention", mutates_args=("k_cache", "v_cache", "counts"))
    def _qkv_attention_op(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, pad: torch.Tensor, slot: torch.Tensor, scale: float,
                          counts: torch.Tensor, groups: int, pdl: bool, q_norm: torch.Tensor, k_norm: torch.Tensor,
                          qk_eps: float) -> torch.Tensor:
        """x [1, K]; ``norm_weight``, ``bias``, ``q_norm``, ``k_norm``: empty for none (every argument given, as
        decode_rotary's op: torch 2.11 drops a mutated optional argument left at its default)."""
        n, k = weight.shape
        d = k_cache.size(-1)
        qpg = n // groups // d - 2
        out = x.new_empty(1, groups, qpg, d)
        qkv = x.new_empty(n)
        pdl = early_launch(pdl, x)
        shape = gemv_row.early_config(n, k) if pdl else {"BLOCK_K": min(1024, triton.next_power_of_2(k)),
                                                         "num_warps": 4, "AHEAD": 1, "POLICY": ""}
        shape = {**shape, "BLOCK_N": BLOCK_N}
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _qkv_attention_kernel[(n // BLOCK_N,)](
                x, weight, norm_weight if norm_weight.numel() else x, bias if bias.numel() else x, qkv, cos, sin,
                k_cache, v_cache, pad, slot, out, counts, n, k, eps, scale, k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(1), v_cache.stride(2), out.stride(1), out.stride(2),
                q_norm if q_norm.numel() else out, k_norm if k_norm.numel() else out, qk_eps,
                NORM=norm_weight.numel() > 0, HAS_BIAS=bias.numel() > 0, PDL=pdl, QPG=qpg,
                QB=max(16, triton.next_power_of_2(qpg)), D=d, BT=decode_rotary.BLOCK_T, QK_NORM=q_norm.numel() > 0,
                **shape, **({"launch_pdl": True} if pdl else {}))
        return out

    @_qkv_attention_op.register_fake
    def _(x, weight, norm_weight, eps, bias, cos, sin, k_cache, v_cache, pad, slot, scale, counts, groups, pdl,
          q_norm, k_norm, qk_eps):
        d = k_cache.size(-1)
        return x.new_empty(1, groups, weight.size(0) // groups // d - 2, d)

"""Blockwise FP8's 1 x 128 tile casts of one operand in both layouts from one read (``--fp8-recipe blockwise`` with
``--kernel-fp8-block-cast``, ``auto``: this kernel wherever Triton runs on CUDA).

The blockwise recipe quantises each activation and output gradient twice: in tiles along its columns for the
forward or input-gradient GEMM (``q`` [M, K], a scale per tile ``s`` [M, ceil(K/128)]) and, transposed, in tiles
along its rows for the weight gradient, which sums over the tokens (``qt`` [K, M], ``st`` [K, ceil(M/128)]). The
plain-torch reference is kernels/fp8_block.py's ``quantize_tiles(x)`` and ``quantize_tiles(x.t())``; under
--torch-compile those become separate passes and the transposed one reads ``x`` along its columns, which was
measured at several times the time of one read of ``x`` on the wide tensors of llama-1b's MLP
(benchmarks/results/expert_gemms_llama-1b_dense_20261204_124803.md). Here a program loads one 128 x 128 tile of
``x`` once and writes both: the tile's rows scaled by their amaxes and stored row-major, and the tile transposed
(in fp32, in registers), its rows (``x``'s columns) scaled by theirs and stored row-major into ``qt``. The numbers
are the reference's (the same fp32 scale, ``fmax / (amax * 2**margin)`` rounded as torch rounds it, 1 where the
amax is 0 or not finite, the same saturating cast). tests/unit/test_fp8_tile_cast.py compares the scales and the
scaled values before the cast bit for bit through Triton's CPU interpreter (whose own FP8 conversion rounds
differently from the GPU's, so the cast itself is left to the GPU test); tests/gpu/test_fp8_tile_cast_cuda.py
compares every output bit for bit on the GPU. What it saves in a training step: docs/moe.md ("Dense blockwise").
A tile holding a NaN may get a different scale than the reference's (Triton's maximum need not propagate it); its
values are NaN either way.
"""
from __future__ import annotations

import contextlib

import torch

from .fp8_block import TILE, quantize_tiles
from .fp8_cast import E4M3, FMAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def reference(x: torch.Tensor, margin: int = 0) -> tuple:
    """(q, s, qt, st) of ``x`` [M, K] by torch ops: kernels/fp8_block.py's tile casts of ``x`` and ``x``^T."""
    return (*quantize_tiles(x, E4M3, margin), *quantize_tiles(x.t(), E4M3, margin))


def _op(x: torch.Tensor, margin: int) -> tuple:
    return torch.ops.paratron.fp8_tile_cast_both(x, margin)


def tiles_both(x: torch.Tensor, margin: int, cast: str) -> tuple:
    """(q, s, qt, st) of the 2-D ``x`` by ``cast``: "triton" (the kernel) or "torch" (the reference)."""
    if cast == "triton":
        return _op(x.contiguous(), margin)
    return reference(x, margin)


def _ceil(n: int) -> int:
    return -(-n // TILE)


if triton is not None:
    @triton.jit
    def _scales(t, MULT, FMAX_: tl.constexpr):
        """The scale of each row of the fp32 tile ``t``: fmax / (amax * 2**margin), 1 where that is not usable;
        computed as torch computes ``fmax / tensor`` (the reciprocal, then the product), so the bits agree."""
        amax = tl.max(tl.abs(t), 1)
        scale = tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax * MULT) * FMAX_
        ok = (amax > 0) & (amax < float("inf")) & (scale < float("inf"))
        return tl.where(ok, scale, 1.0)

    @triton.jit
    def _tile_cast_both(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, KB, MB, MULT, FMAX_: tl.constexpr,
                        T: tl.constexpr):
        pm, pk = tl.program_id(0), tl.program_id(1)
        rows = (pm * T + tl.arange(0, T)).to(tl.int64)
        cols = (pk * T + tl.arange(0, T)).to(tl.int64)
        live_r, live_c = rows < M, cols < K
        mask = live_r[:, None] & live_c[None, :]
        t = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sr = _scales(t, MULT, FMAX_)
        q = tl.clamp(t * sr[:, None], -FMAX_, FMAX_).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * KB + pk, sr, mask=live_r)
        tt = tl.trans(t)  # [columns of x, rows of x], still fp32: the cast below is stored row-major
        sc = _scales(tt, MULT, FMAX_)
        qt = tl.clamp(tt * sc[:, None], -FMAX_, FMAX_).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], qt, mask=live_c[:, None] & live_r[None, :])
        tl.store(st_ptr + cols * MB + pm, sc, mask=live_c)

    @torch.library.custom_op("paratron::fp8_tile_cast_both", mutates_args=())
    def tile_cast_both(x: torch.Tensor, margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, s, qt, st) of the contiguous 2-D ``x`` (the module docstring's), e4m3 with fp32 scales."""
        m, k = x.shape
        q, qt = torch.empty(m, k, device=x.device, dtype=E4M3), torch.empty(k, m, device=x.device, dtype=E4M3)
        s = torch.empty(m, _ceil(k), device=x.device, dtype=torch.float32)
        st = torch.empty(k, _ceil(m), device=x.device, dtype=torch.float32)
        if x.numel():
            with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
                _tile_cast_both[(_ceil(m), _ceil(k))](x, q, s, qt, st, m, k, _ceil(k), _ceil(m), 2.0 ** margin,
                                                      FMAX_=FMAX[E4M3], T=TILE, num_warps=8)
        return q, s, qt, st

    @tile_cast_both.register_fake
    def _(x, margin):
        m, k = x.shape
        return (x.new_empty(m, k, dtype=E4M3), x.new_empty(m, _ceil(k), dtype=torch.float32),
                x.new_empty(k, m, dtype=E4M3), x.new_empty(k, _ceil(m), dtype=torch.float32))

"""Blockwise FP8's SwiGLU written straight into 1 x 128 tiles in both layouts (``--fp8-recipe blockwise``, the
fused MLP of paratron/fp8/block_mlp.py).

Layer by layer, the blockwise MLP writes the SwiGLU's output [M, F] in bf16 and reads it again to cast it in tiles
(``kernels/fp8_tile_cast.py``), and in the backward writes the SwiGLU's input gradient [M, 2F] (the widest tensor
of the layer) in bf16 and reads it again for the same cast. Here a program loads the gate and up tiles of fc1's
output (and, backward, the output gradient's tile), computes the SwiGLU or its gradient in fp32 and writes the FP8
tiles straight away: row-major with a scale per 1 x 128 tile along the row (the next GEMM's operand) and
transposed with a scale per 1 x 128 tile along the tokens (the weight gradient's). Blockwise scales are local to a
tile, so one pass suffices (the tensorwise fused MLP needs an amax pass first).

Numerics: the recipe's scales and saturating cast (kernels/fp8_block.py), of the SwiGLU's fp32 values rather than
their bf16 rounding (as the tensorwise fused MLP does). The references (``swiglu_tiles_reference``,
``swiglu_grad_tiles_reference``) are torch expressions with kernels/fp8_cast.py's formulas; the kernels'
exponentials may differ from torch's in the last bits, so tests compare with a tolerance: tests/unit/
test_fp8_block_mlp.py (Triton's CPU interpreter, before the FP8 conversion, and an sm90 compile),
tests/gpu/test_fp8_block_mlp_cuda.py (every output on a GPU).
"""
from __future__ import annotations

import contextlib

import torch

from .fp8_block import TILE, quantize_tiles
from .fp8_cast import E4M3, FMAX, SWIGLU, activation, activation_grad

try:
    import triton
    import triton.language as tl
    from .fp8_tile_cast import _scales
except ImportError:  # CPU-only installs
    triton = None


def _ceil(n: int) -> int:
    return -(-n // TILE)


def _both(a: torch.Tensor, margin: int) -> tuple:
    return (*quantize_tiles(a, E4M3, margin), *quantize_tiles(a.t(), E4M3, margin))


def swiglu_tiles_reference(h: torch.Tensor, margin: int) -> tuple:
    """(q, s, qt, st) of SwiGLU(h) for fc1's output ``h`` [M, 2F] (gate, then up), computed in fp32."""
    return _both(activation(h.float(), SWIGLU), margin)


def swiglu_grad_tiles_reference(h: torch.Tensor, dout: torch.Tensor, margin: int) -> tuple:
    """(q, s, qt, st) of the SwiGLU's input gradient [M, 2F] for the output gradient ``dout`` [M, F], in fp32."""
    return _both(activation_grad(h.float(), dout.float(), SWIGLU), margin)


def _outputs(m: int, n: int, device) -> tuple:
    return (torch.empty(m, n, device=device, dtype=E4M3), torch.empty(m, _ceil(n), device=device, dtype=torch.float32),
            torch.empty(n, m, device=device, dtype=E4M3), torch.empty(n, _ceil(m), device=device, dtype=torch.float32))


if triton is not None:
    @triton.jit
    def _store_both(a, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols, live_r, live_c, M, N, NB, MB, pm, pn, MULT,
                    FMAX_: tl.constexpr):
        """The fp32 tile ``a`` (rows x cols of an [M, N] tensor) cast with a scale per row (q, s) and, transposed,
        per column (qt, st): kernels/fp8_tile_cast.py's layouts."""
        sr = _scales(a, MULT, FMAX_)
        q = tl.clamp(a * sr[:, None], -FMAX_, FMAX_).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=live_r[:, None] & live_c[None, :])
        tl.store(s_ptr + rows * NB + pn, sr, mask=live_r)
        at = tl.trans(a)
        sc = _scales(at, MULT, FMAX_)
        qt = tl.clamp(at * sc[:, None], -FMAX_, FMAX_).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], qt, mask=live_c[:, None] & live_r[None, :])
        tl.store(st_ptr + cols * MB + pm, sc, mask=live_c)

    @triton.jit
    def _swiglu_tiles(h_ptr, d_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, F, MB, MULT, FMAX_: tl.constexpr,
                      T: tl.constexpr, GRAD: tl.constexpr):
        """Program (row tile, column tile of F): forward, SwiGLU's tile of [M, F]; GRAD, the gate's and the up's
        gradient tiles of [M, 2F] (columns c and F + c)."""
        pm, pf = tl.program_id(0), tl.program_id(1)
        rows = (pm * T + tl.arange(0, T)).to(tl.int64)
        cols = (pf * T + tl.arange(0, T)).to(tl.int64)
        live_r, live_c = rows < M, cols < F
        mask = live_r[:, None] & live_c[None, :]
        at = rows[:, None] * (2 * F) + cols[None, :]
        gate = tl.load(h_ptr + at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + at + F, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        if GRAD:
            d = tl.load(d_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dup = d * gate * sig  # (both gradients first: then only they are live through the stores)
            dgate = d * up * sig * (1.0 + gate * (1.0 - sig))
            _store_both(dgate, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols, live_r, live_c, M, 2 * F, 2 * tl.cdiv(F, T),
                        MB, pm, pf, MULT, FMAX_)
            _store_both(dup, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols + F, live_r, live_c, M, 2 * F,
                        2 * tl.cdiv(F, T), MB, pm, pf + tl.cdiv(F, T), MULT, FMAX_)
        else:
            _store_both(gate * sig * up, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols, live_r, live_c, M, F,
                        tl.cdiv(F, T), MB, pm, pf, MULT, FMAX_)


def _launch(h: torch.Tensor, dout, margin: int) -> tuple:
    m, f = h.shape[0], h.shape[1] // 2
    out = _outputs(m, 2 * f if dout is not None else f, h.device)
    if m and f:
        with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
            _swiglu_tiles[(_ceil(m), _ceil(f))](h, h if dout is None else dout, *out, m, f, _ceil(m), 2.0 ** margin,
                                                FMAX_=FMAX[E4M3], T=TILE, GRAD=dout is not None, num_warps=8)
    return out


def _check(h: torch.Tensor) -> None:
    if h.dim() != 2 or h.shape[1] % (2 * TILE):
        raise ValueError(f"the blockwise SwiGLU takes fc1's output [M, 2F] with F a multiple of {TILE}, got "
                         f"{tuple(h.shape)}")


@torch.library.custom_op("paratron::fp8_block_swiglu", mutates_args=())
def swiglu_tiles(h: torch.Tensor, margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, qt, st) of SwiGLU(h) in e4m3 tiles, both layouts (the module docstring); off CUDA, the reference."""
    _check(h)
    if triton is None or not h.is_cuda:
        return swiglu_tiles_reference(h, margin)
    return _launch(h.contiguous(), None, margin)


@swiglu_tiles.register_fake
def _(h, margin):
    m, f = h.shape[0], h.shape[1] // 2
    return (h.new_empty(m, f, dtype=E4M3), h.new_empty(m, _ceil(f), dtype=torch.float32),
            h.new_empty(f, m, dtype=E4M3), h.new_empty(f, _ceil(m), dtype=torch.float32))


@torch.library.custom_op("paratron::fp8_block_swiglu_backward", mutates_args=())
def swiglu_grad_tiles(h: torch.Tensor, dout: torch.Tensor,
                      margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, qt, st) of the SwiGLU's input gradient [M, 2F] for ``dout`` [M, F], e4m3 tiles in both layouts."""
    _check(h)
    if triton is None or not h.is_cuda:
        return swiglu_grad_tiles_reference(h, dout, margin)
    return _launch(h.contiguous(), dout.contiguous(), margin)


@swiglu_grad_tiles.register_fake
def _(h, dout, margin):
    m, n = h.shape
    return (h.new_empty(m, n, dtype=E4M3), h.new_empty(m, _ceil(n), dtype=torch.float32),
            h.new_empty(n, m, dtype=E4M3), h.new_empty(n, _ceil(m), dtype=torch.float32))

"""Blockwise FP8 scaling (DeepSeek-V3's recipe, ``--fp8-recipe blockwise``) and its GEMMs.

A tensor is cut into tiles along its rows: ``tiles`` gives each 1 x 128 run of a row (activations and
gradients) its own scale, ``blocks`` each 128 x 128 square (weights). A scale is what the values are
multiplied by before the cast, ``fmax / (amax * 2**margin)`` of its tile (1 where the tile is all zero),
the same rule as the tensorwise recipe's (kernels/fp8_cast.py), applied per tile. Sizes that are not
multiples of 128 leave a partial last tile, scaled by its own amax.

GEMMs of blockwise operands, :func:`block_mm` (``a`` [M, K] in 1 x 128 tiles, ``b`` [N, K] in tiles or
blocks, both along K; returns a b^T [M, N]), by one of three paths (``--kernel-fp8-block-gemm``):

* ``scaled_mm``: ``torch.nn.functional.scaled_mm`` with float32 block scales, cuBLAS's blockwise FP8 GEMM
  (Hopper, CUDA >= 12.9; the scale layouts it checks are ``scaled_mm_scales``'s);
* ``deepgemm``: DeepGEMM's sm90 kernels (kernels/experimental/deepgemm.py: a pinned build of DeepGEMM);
* ``dequant``: both operands dequantised to bf16 and multiplied by torch's bf16 GEMM: the recipe's numbers
  (what the FP8 copies hold) without FP8 speed, on any GPU;
* ``emulate``: dequantised to fp32 and multiplied in fp32, the reference of the CPU tests.

:func:`block_mm_accumulate` adds the weight gradient's product (both operands in tiles along the tokens) to a
float32 buffer in place, by the same paths: Megatron's gradient-accumulation fusion under the blockwise recipe
(paratron/fp8/blockwise.py), where DeepGEMM's kernel accumulates into the buffer itself.
"""
from __future__ import annotations

import torch

from .experimental import deepgemm  # (also registers paratron::deepgemm_block_mm)
from .fp8_cast import E4M3, FMAX, compute_scale

TILE = 128
BLOCK_GEMMS = ("scaled_mm", "deepgemm", "dequant", "emulate")


def _ceil(n: int, d: int = TILE) -> int:
    return -(-n // d)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` [r, c] with zero rows / columns added up to [rows, cols] (``x`` itself when nothing is added)."""
    if tuple(x.shape) == (rows, cols):
        return x
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _scaled(x: torch.Tensor, s: torch.Tensor, row_block: int, divide: bool) -> torch.Tensor:
    """fp32 ``x`` [M, K] times (``divide``: over) the scale of its tile (``row_block`` 1, ``s`` [M, K/128]) or
    block (``row_block`` 128, ``s`` [M/128, K/128]): each tile is a view the scale broadcasts over, no
    per-element scale tensor is made (under --torch-compile the cast is one fused pass)."""
    m, k = x.shape
    mb, kb = s.shape
    tiles = _padded(x.float(), mb * row_block, kb * TILE).reshape(mb, row_block, kb, TILE)
    scale = s[:, None, :, None]
    y = tiles / scale if divide else tiles * scale
    return y.reshape(mb * row_block, kb * TILE)[:m, :k]


def tile_scales(x: torch.Tensor, dtype: torch.dtype = E4M3, margin: int = 0) -> torch.Tensor:
    """The scale of each 1 x 128 tile of ``x`` [M, K]: [M, ceil(K / 128)] fp32."""
    m, k = x.shape
    amax = _padded(x.float().abs(), m, _ceil(k) * TILE).reshape(m, _ceil(k), TILE).amax(dim=2)
    return compute_scale(amax, FMAX[dtype], margin)


def block_scales(w: torch.Tensor, dtype: torch.dtype = E4M3, margin: int = 0) -> torch.Tensor:
    """The scale of each 128 x 128 block of ``w`` [N, K]: [ceil(N / 128), ceil(K / 128)] fp32."""
    n, k = w.shape
    nb, kb = _ceil(n), _ceil(k)
    amax = _padded(w.float().abs(), nb * TILE, kb * TILE).reshape(nb, TILE, kb, TILE).amax(dim=(1, 3))
    return compute_scale(amax, FMAX[dtype], margin)


def expand(scale: torch.Tensor, rows: int, cols: int, row_block: int) -> torch.Tensor:
    """Per-element scales [rows, cols] of tile scales (``row_block`` 1) or block scales (128) (for tests and
    error bounds: the casts broadcast the scales over views of the tiles instead)."""
    return scale.repeat_interleave(row_block, 0)[:rows].repeat_interleave(TILE, 1)[:, :cols]


def _cast(x: torch.Tensor, s: torch.Tensor, row_block: int, dtype: torch.dtype) -> torch.Tensor:
    fmax = FMAX[dtype]
    return _scaled(x, s, row_block, divide=False).clamp(-fmax, fmax).to(dtype).contiguous()


def quantize_tiles(x: torch.Tensor, dtype: torch.dtype = E4M3, margin: int = 0):
    """``x`` [M, K] in FP8 with a scale per 1 x 128 tile: (q [M, K], scales [M, ceil(K/128)])."""
    s = tile_scales(x, dtype, margin)
    return _cast(x, s, 1, dtype), s


def quantize_blocks(w: torch.Tensor, dtype: torch.dtype = E4M3, margin: int = 0):
    """``w`` [N, K] in FP8 with a scale per 128 x 128 block: (q [N, K], scales [ceil(N/128), ceil(K/128)])."""
    s = block_scales(w, dtype, margin)
    return _cast(w, s, TILE, dtype), s


def dequantize_tiles(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _scaled(q, s, 1, divide=True).to(dtype)


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _scaled(q, s, TILE, divide=True).to(dtype)


def dequantize(q: torch.Tensor, s: torch.Tensor, b_blocks: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Either kind of operand back in ``dtype`` (``b_blocks``: 128 x 128 block scales, else 1 x 128 tiles)."""
    return dequantize_blocks(q, s, dtype) if b_blocks else dequantize_tiles(q, s, dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def scaled_mm_scales(sa: torch.Tensor, sb: torch.Tensor, b_blocks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse scales laid out as cuBLAS's blockwise GEMM reads them through ``F.scaled_mm``: a's 1 x 128
    tile scales [M, K/128] column-major; b's 128 x 128 block scales [N/128, K/128] with the K blocks padded to
    a multiple of 4 and transposed ([K4, N/128], column-major), or b's tile scales [N, K/128] column-major.
    torch's older ``_scaled_mm`` took unpadded block scales without complaint and read past them when K/128
    was not a multiple of 4 (seen on an H200: ``benchmarks/results/fp8_blockwise_layout_h200_20261202.md``)."""
    inv_b = sb.reciprocal()
    if b_blocks:
        # pad's result keeps a transposed input's strides when nothing is padded (the input gradient's GEMM
        # reads the weight's scales as a transposed view): made row-major before the transpose
        scale_b = torch.nn.functional.pad(inv_b, (0, -inv_b.shape[1] % 4)).contiguous().t()
    else:
        scale_b = _column_major(inv_b)
    return _column_major(sa.reciprocal()), scale_b


def block_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_blocks: bool,
             out_dtype: torch.dtype, path: str) -> torch.Tensor:
    """a b^T for FP8 ``a`` [M, K] (scales ``sa`` per 1 x 128 tile) and ``b`` [N, K] (scales ``sb`` per
    128 x 128 block when ``b_blocks``, else per 1 x 128 tile), by ``path`` (one of BLOCK_GEMMS)."""
    if path == "emulate":
        return (dequantize_tiles(a, sa) @ dequantize(b, sb, b_blocks).t()).to(out_dtype)
    if path == "dequant":
        return dequantize_tiles(a, sa, out_dtype) @ dequantize(b, sb, b_blocks, out_dtype).t()
    if path == "deepgemm":  # (kernels/experimental/deepgemm.py; shapes it does not take: the cuBLAS path)
        return deepgemm.mm(a, sa, b, sb, b_blocks, out_dtype)
    return scaled_block_mm(a, sa, b, sb, b_blocks, out_dtype)


def block_mm_accumulate(out: torch.Tensor, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                        path: str, dtype: torch.dtype = torch.float32) -> None:
    """``out += a b^T`` in place for FP8 ``a`` [N, M] and ``b`` [K, M], both with a scale per 1 x 128 tile along
    M (the summed dimension: the weight gradient's tokens), ``out`` [N, K] (a float32 ``main_grad``), by ``path``
    (one of BLOCK_GEMMS): DeepGEMM accumulating into ``out`` itself, or the product added (``scaled_mm``: cuBLAS's,
    in its bf16 output as :func:`scaled_block_mm` takes it; ``dequant``: the dequantised operands' GEMM in ``dtype``,
    the weights' as the unfused gradient's; ``emulate``: in fp32)."""
    if path == "deepgemm":
        deepgemm.mm_accumulate(out, a, sa, b, sb)
    elif path == "scaled_mm":
        out.add_(scaled_block_mm(a, sa, b, sb, False, torch.float32))
    else:
        out.add_(block_mm(a, sa, b, sb, False, dtype if path == "dequant" else torch.float32, path))


@torch.library.custom_op("paratron::fp8_scaled_block_mm", mutates_args=())
def scaled_block_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_blocks: bool,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """The ``scaled_mm`` path of :func:`block_mm` as an operator of its own: torch.compile cannot trace
    ``F.scaled_mm`` (``torch._scaled_mm_v2`` breaks the graph, and a break inside the blockwise linear's autograd
    function left its quantisation eager), so the traced graph holds this call and Inductor fuses the
    casts around it. On CUDA: cuBLAS's blockwise FP8 GEMM; elsewhere the dequantised product in fp32 (the
    reference the CPU tests compare it with; ``gemm_choice`` never picks this path off Hopper)."""
    if not a.is_cuda:
        return block_mm(a, sa, b, sb, b_blocks, out_dtype, "emulate")
    kinds = torch.nn.functional.ScalingType
    scale_a, scale_b = scaled_mm_scales(sa, sb, b_blocks)
    return torch.nn.functional.scaled_mm(a.contiguous(), b.contiguous().t(), scale_a, kinds.BlockWise1x128, scale_b,
                                         kinds.BlockWise128x128 if b_blocks else kinds.BlockWise1x128,
                                         output_dtype=torch.bfloat16).to(out_dtype)  # (bf16 out: the one tested)


@scaled_block_mm.register_fake
def _(a, sa, b, sb, b_blocks, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


def gemm_choice(device) -> tuple[str, str]:
    """What ``--kernel-fp8-block-gemm auto`` runs on ``device``, and why: DeepGEMM's where the pinned build is
    installed (faster than cuBLAS's blockwise GEMM, benchmarks/results/deepgemm_probe_h100_20261207.md); else
    cuBLAS's, which needs a Hopper GPU and CUDA >= 12.9 (torch's check); elsewhere the bf16 GEMM of the dequantised
    operands."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return "dequant", "needs CUDA (Hopper, CUDA >= 12.9)"
    if deepgemm.refusal(dev) is None:
        return "deepgemm", f"DeepGEMM {deepgemm.VERSION} installed: faster than cuBLAS's blockwise GEMM (docs/moe.md)"
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if torch.cuda.get_device_capability(dev) != (9, 0) or cuda < (12, 9):
        return "dequant", "cuBLAS's blockwise FP8 GEMM needs Hopper (sm90) and CUDA >= 12.9"
    return "scaled_mm", "torch's scaled_mm with block scales (Hopper, CUDA >= 12.9; DeepGEMM not installed)"

"""DeepGEMM's Hopper FP8 GEMMs with DeepSeek-V3's block scales, for ``--fp8-recipe blockwise``
(``--kernel-fp8-block-gemm deepgemm``: the dense linears' three GEMMs; ``--kernel-fp8-block-grouped-gemm deepgemm``:
the routed experts' forward and input gradient).

DeepGEMM (https://github.com/deepseek-ai/DeepGEMM, MIT licence) compiles its kernels at first use of each shape
with the CUDA compiler (``nvcc`` must be on the machine; the compiled kernels are cached under ``~/.deep_gemm``).
It has no current release on PyPI (the 1.0.0 there predates its sm90 interface), so it is built from its
repository, and paratron pins the version whose interface it calls (``VERSION``): with another version installed,
or none, the switch refuses by name; ``auto`` takes DeepGEMM where the pinned version is installed on a Hopper
GPU, else cuBLAS's blockwise GEMM and the dequant experts (kernels/README.md, "Experimental").

The operands are kernels/fp8_block.py's :func:`~paratron.kernels.fp8_block.block_mm`'s: ``a`` [M, K] e4m3 with a
scale per 1 x 128 tile along K, ``b`` [N, K] with a scale per 128 x 128 block (the forward and the input gradient:
DeepGEMM's "1D2D" kernel) or per 1 x 128 tile (the weight gradient, both operands along the tokens: its "1D1D"
kernel). paratron's scales multiply before the cast; DeepGEMM takes the dequantisation factors, their
reciprocals. Its sm90 kernels read both operands K-major, so a transposed view is copied (the input gradient's
weight, as cuBLAS's path does). Shapes it cannot take (K or N not a multiple of 128) go to cuBLAS's blockwise GEMM,
the same numbers.

:func:`mm_accumulate` is the 1D1D GEMM adding into a float32 buffer the caller holds (a weight's ``main_grad``:
Megatron's gradient-accumulation fusion under the blockwise recipe), the kernel's ``D = C + A B^T`` with C and D
that buffer, where :func:`mm` accumulates into a zeroed output and returns it.

The grouped form takes the experts' rows as paratron's dispatch lays them out for block scales (sorted by expert,
each expert starting at a multiple of 128, ``ends`` the cumulative end rows): DeepGEMM's "psum" contiguous layout.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from ..tail_rows import zero_from

VERSION = "2.6.1"  # DeepGEMM's version whose interface is called here (fp8_gemm_nt, m_grouped_..._contiguous)
TILE = 128


@functools.lru_cache(maxsize=1)
def _module():
    """deep_gemm when the pinned version imports, else None."""
    return importlib.import_module("deep_gemm") if installed_version() == VERSION else None


def available() -> bool:
    """Whether the pinned DeepGEMM imports: a constant to the compiler, which would otherwise trace the import probe
    behind :func:`_module` and break the graph wherever :func:`mm` / :func:`grouped_mm` are compiled."""
    return _module() is not None


# torch.compiler.assume_constant_result's mark, set as it sets it (torch 2.11 and 2.13; tests/unit/test_deepgemm.py
# checks they agree): the decorator imports torch._dynamo, about 2 s on a CPU, which every command importing the
# kernel switches (`paratron plan`) would pay for nothing
available._dynamo_marked_constant = True


def installed_version() -> Optional[str]:
    """deep_gemm's version, or None where it does not import (not installed, or its extension does not load)."""
    try:
        import deep_gemm
    except Exception:  # noqa: BLE001
        return None
    return getattr(deep_gemm, "__version__", "unknown")


def refusal(device) -> Optional[str]:
    """Why DeepGEMM's GEMMs cannot run on ``device`` (None: they can)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return "DeepGEMM's FP8 GEMMs need a Hopper GPU (sm90)"
    if torch.cuda.get_device_capability(dev) != (9, 0):
        return "DeepGEMM's FP8 GEMMs with float32 block scales run on Hopper (sm90) only"
    if _module() is None:
        found = installed_version()
        return (f"needs DeepGEMM {VERSION} (found {found}); build it from github.com/deepseek-ai/DeepGEMM"
                if found else f"needs DeepGEMM {VERSION}, built from github.com/deepseek-ai/DeepGEMM (not installed)")
    return None


def fits(m: int, n: int, k: int) -> bool:
    """Whether DeepGEMM takes a GEMM of this shape (whole 128-wide tiles along N and K)."""
    return m > 0 and n % TILE == 0 and k % TILE == 0


def mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_blocks: bool,
       out_dtype: torch.dtype) -> torch.Tensor:
    """a b^T ([M, N], ``out_dtype``) of blockwise FP8 operands (the module docstring's) by DeepGEMM; off CUDA,
    without the pinned build or at a shape it does not take, kernels/fp8_block.py's cuBLAS path (on CPU: its fp32
    emulation). DeepGEMM's dequantisation factors (the scales' reciprocals) and its K-major copies of transposed
    operands are taken here, outside the operator, where the compiler fuses them into its own kernels."""
    m, k = a.shape
    n = b.shape[0]
    if not available() or not a.is_cuda or not fits(m, n, k):
        from ..fp8_block import scaled_block_mm
        return scaled_block_mm(a, sa, b, sb, b_blocks, out_dtype)
    return torch.ops.paratron.deepgemm_block_mm(a.contiguous(), sa.reciprocal(), b.contiguous(),
                                                sb.reciprocal().contiguous(), b_blocks, out_dtype)


def mm_accumulate(out: torch.Tensor, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> None:
    """``out += a b^T`` in place (``out`` [N, K] float32; ``a`` [N, M], ``b`` [K, M], both with a scale per
    1 x 128 tile along M) by DeepGEMM's 1D1D kernel accumulating into ``out``; off CUDA, without the pinned build,
    at a shape it does not take or for an ``out`` it cannot write (not contiguous float32), the product of
    kernels/fp8_block.py's cuBLAS path (on CPU: its fp32 emulation) added in place."""
    m, k = a.shape
    n = b.shape[0]
    if (not available() or not a.is_cuda or not fits(m, n, k) or out.dtype != torch.float32
            or not out.is_contiguous()):
        from ..fp8_block import scaled_block_mm
        out.add_(scaled_block_mm(a, sa, b, sb, False, torch.float32))
        return
    torch.ops.paratron.deepgemm_block_mm_acc(out, a.contiguous(), sa.reciprocal(), b.contiguous(),
                                             sb.reciprocal().contiguous())


def grouped_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, ends: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``a`` [S, K] of expert e times ``b[e]``^T ([E, N, K], ``sb`` [E N/128, K/128]): [S, N], rows past the
    last end zero. ``ends``: the groups' cumulative end rows, multiples of 128 (parallel/experts.py's
    ``aligned_rows``: each expert's rows start at a multiple of 128, so the groups cover every row up to the last
    end). Off CUDA or without the pinned build: kernels/fp8_grouped.py's dequant path."""
    s, k = a.shape
    e, n, _ = b.shape
    if not available() or not a.is_cuda or not fits(s, n, k):
        from .. import fp8_grouped
        return fp8_grouped.grouped_forward(a, sa, b, sb, ends, "block", out_dtype, "dequant")
    return torch.ops.paratron.deepgemm_block_grouped_mm(a.contiguous(), sa.reciprocal(), b.contiguous(),
                                                        sb.reciprocal().view(e, n // TILE, -1),
                                                        ends.to(torch.int32).contiguous(), out_dtype)


def _refuse_off_cuda(a: torch.Tensor) -> None:
    if not a.is_cuda or _module() is None:
        raise RuntimeError(f"paratron's DeepGEMM operators run on a Hopper GPU with DeepGEMM {VERSION}; call "
                           "kernels/experimental/deepgemm.py's mm / grouped_mm, which fall back elsewhere")


@torch.library.custom_op("paratron::deepgemm_block_mm", mutates_args=())
def block_mm(a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor, b_blocks: bool,
             out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`mm` on CUDA: ``ia``, ``ib`` the dequantisation factors (1 / scale), both operands K-major."""
    _refuse_off_cuda(a)
    m, n = a.shape[0], b.shape[0]
    if b_blocks:
        out = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
        _module().fp8_gemm_nt((a, ia), (b, ib), out)
    else:  # the 1D1D kernel (both operands in tiles) only accumulates into a float32 output: D = C + A B^T
        out = torch.zeros(m, n, device=a.device, dtype=torch.float32)
        _module().fp8_gemm_nt((a, ia), (b, ib), out, c=out, recipe=(1, 1, TILE))
    return out if out.dtype == out_dtype else out.to(out_dtype)


@block_mm.register_fake
def _(a, ia, b, ib, b_blocks, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@torch.library.custom_op("paratron::deepgemm_block_mm_acc", mutates_args=("out",))
def block_mm_acc(out: torch.Tensor, a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor) -> None:
    """:func:`mm_accumulate` on CUDA: ``ia``, ``ib`` the dequantisation factors (1 / scale), both operands K-major,
    ``out`` contiguous float32 (the kernel's C and D)."""
    _refuse_off_cuda(a)
    _module().fp8_gemm_nt((a, ia), (b, ib), out, c=out, recipe=(1, 1, TILE))


@block_mm_acc.register_fake
def _(out, a, ia, b, ib):
    return None


@torch.library.custom_op("paratron::deepgemm_block_grouped_mm", mutates_args=())
def block_grouped_mm(a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor, ends: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`grouped_mm` on CUDA (``ia``, ``ib``: dequantisation factors; ``ends`` int32). DeepGEMM writes the
    groups' rows only; the rows past the last end are zeroed by kernels/tail_rows.py's kernel, reading the end row
    on the device (a few tiles of rows, where zeroing the whole output first was a pass over it)."""
    _refuse_off_cuda(a)
    dg = _module()
    if dg.get_mk_alignment_for_contiguous_layout() != TILE:  # (a setting of the library's; 128 by default on sm90)
        dg.set_mk_alignment_for_contiguous_layout(TILE)
    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.bfloat16)
    dg.m_grouped_fp8_gemm_nt_contiguous((a, ia), (b, ib), out, ends, use_psum_layout=True)
    zero_from(out, ends)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


@block_grouped_mm.register_fake
def _(a, ia, b, ib, ends, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)

"""Zero the rows of a 2-D tensor from a row index held on the device to its end, without reading the index back.

Used for DeepGEMM's grouped GEMM (kernels/experimental/deepgemm.py): it writes the rows of the experts' groups only,
and the rows past the last group's end must come out zero (the blockwise experts' contract); zeroing the whole
output before the GEMM was a pass over it, where the rows past the end are at most a few tiles.

``zero_from_reference`` is the plain-torch reference (a mask over every row); ``zero_from`` runs the Triton kernel on
CUDA (a fixed grid of programs striding over the rows from the start row, read on the device), else the reference.
tests/unit/test_tail_rows.py checks the kernel against the reference in Triton's CPU interpreter and that it
compiles for Hopper; tests/gpu/test_tail_rows_cuda.py runs it on a GPU."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

PROGRAMS = 256  # programs striding over the rows past the start (a few tiles of rows: one wave)
BLOCK = 1024  # columns a program zeroes at a time


def zero_from_reference(out: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``out`` [S, N] with its rows from ``starts[-1]`` on set to zero, in place (torch ops)."""
    rows = torch.arange(out.shape[0], device=out.device)
    return out.masked_fill_((rows >= starts[-1].to(rows.dtype))[:, None], 0)


def zero_from(out: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``out`` [S, N] (rows contiguous) with its rows from ``starts[-1]`` on set to zero, in place."""
    if triton is None or not out.is_cuda or out.stride(1) != 1:
        return zero_from_reference(out, starts)
    if out.numel():
        with torch.cuda.device(out.device):
            _zero_from[(PROGRAMS,)](out, starts, starts.numel() - 1, out.shape[0], out.shape[1], out.stride(0),
                                    BLOCK=BLOCK, STEP=PROGRAMS)
    return out


if triton is not None:
    @triton.jit
    def _zero_from(out_ptr, start_ptr, LAST, S, N, stride, BLOCK: tl.constexpr, STEP: tl.constexpr):
        start = tl.load(start_ptr + LAST).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        zeros = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.range(start + tl.program_id(0), S, STEP):
            for c in tl.range(0, N, BLOCK):
                tl.store(out_ptr + r * stride + c + cols, zeros, mask=c + cols < N)

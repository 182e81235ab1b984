"""Gradient accumulation kernels: a micro-batch gradient into its fp32 ``main_grad`` buffer, the fused
weight-gradient GEMM that adds ``dY^T X`` straight into it, the embedding table's scattered add, and the
residual added as a GEMM's C operand. Each op falls back to the plain torch expression (its reference) where
its kernel does not run (CPUs, other dtypes, non-contiguous operands).

Gradient-accumulation fusion (Megatron's, on unless ``--no-gradient-accumulation-fusion``) is the reason the
weight-gradient GEMM writes fp32 into the buffer: the bf16 gradient is never written, read back and added.
Which weights take it is decided by the linear dispatch (paratron/parallel/linear.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import quack_gemm
from . import cublaslt as lt

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

ACC_BLOCK = 4096  # elements per program of the accumulation kernels


def accumulate_(acc: Tensor, grad: Tensor, write: bool, fused: bool = True) -> None:
    """``acc = grad`` (``write``) or ``acc += grad``: a micro-batch gradient into its ``main_grad``. With
    ``fused``, for fp32 ``acc`` and a bf16/fp16 ``grad`` (contiguous, same shape) on CUDA, one vectorised
    Triton pass: torch's mixed-dtype copy_ / add_ run its unvectorised casting loop, well below the memory
    bandwidth (those two kernels in llama-1b's step profile:
    benchmarks/results/profile_kernels_llama-1b_mb16x2_flash4_e7bfd57_h200.tsv). Otherwise torch's copy_ / add_."""
    if (fused and triton is not None and acc.is_cuda and acc.dtype == torch.float32
            and grad.dtype in (torch.bfloat16, torch.float16)
            and acc.is_contiguous() and grad.is_contiguous() and acc.shape == grad.shape):
        n = acc.numel()
        with torch.cuda.device(acc.device):
            _accumulate[(triton.cdiv(n, ACC_BLOCK),)](acc, grad, n, WRITE=write, BLOCK=ACC_BLOCK)
    elif write:
        acc.copy_(grad)
    else:
        acc.add_(grad)


def accumulate_deinterleaved_(acc: Tensor, grad: Tensor) -> None:
    """``acc += grad`` with ``grad``'s rows interleaved ([g0, u0, g1, u1, ...]) and ``acc``'s in halves
    ([gate; up]): the gated MLP's fc1 weight gradient, which its GEMMs produce interleaved. One Triton pass
    on CUDA (contiguous fp32 ``acc``, bf16/fp16 ``grad``); torch's strided add elsewhere."""
    rows = acc.size(0)
    if (triton is not None and acc.is_cuda and acc.dtype == torch.float32 and grad.dtype != torch.float32
            and acc.is_contiguous() and grad.is_contiguous() and acc.shape == grad.shape and rows % 2 == 0):
        cols = acc.numel() // rows
        with torch.cuda.device(acc.device):
            _accumulate_deinterleaved[(rows, triton.cdiv(cols, ACC_BLOCK))](acc, grad, rows // 2, cols,
                                                                           BLOCK=ACC_BLOCK)
    else:
        acc.view(2, rows // 2, -1).add_(grad.reshape(rows // 2, 2, -1).transpose(0, 1))


if triton is not None:
    @triton.jit
    def _accumulate(acc_ptr, g_ptr, n, WRITE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        if not WRITE:
            g += tl.load(acc_ptr + offs, mask=mask)
        tl.store(acc_ptr + offs, g, mask=mask)

    @triton.jit
    def _accumulate_deinterleaved(acc_ptr, g_ptr, half, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # destination row: [gate; up] order
        src = (row % half) * 2 + row // half  # its row in the interleaved gradient
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        dst = acc_ptr + row.to(tl.int64) * cols + offs
        g = tl.load(g_ptr + src.to(tl.int64) * cols + offs, mask=mask).to(tl.float32)
        tl.store(dst, tl.load(dst, mask=mask) + g, mask=mask)


@torch.library.custom_op("paratron::wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(main_grad: Tensor, dy: Tensor, x: Tensor, interleaved: bool) -> None:
    """``main_grad += dy^T @ x`` (``dy`` [tokens, out], ``x`` [tokens, in]); with ``interleaved`` the
    product's rows are the gated MLP's interleaved order and are added to ``main_grad``'s [gate; up]
    halves. A custom op so that a compiled backward keeps it as one opaque node mutating the buffer."""
    if interleaved:
        accumulate_deinterleaved_(main_grad, dy.t() @ x)
    elif main_grad.dtype == dy.dtype or not main_grad.is_cuda:  # (CPUs: the product in the buffer's dtype)
        main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))
    else:  # bf16 operands, fp32 output accumulating in place
        torch.addmm(main_grad, dy.t(), x, out_dtype=main_grad.dtype, out=main_grad)


@wgrad_accumulate.register_fake
def _wgrad_accumulate_fake(main_grad, dy, x, interleaved):
    return None


def residual_addmm(c: Tensor, a: Tensor, weight: Tensor, cublaslt: bool = True) -> Tensor:
    """``c + a W^T`` into a new tensor in training (the residual as the GEMM's C operand, not copied into the
    output first): quack's GEMM reading C where its ``residual`` tiles are on (quack_gemm.py), else cuBLASLt
    (cublaslt.py; torch's addmm where that does not run)."""
    if quack_gemm.residual_applies(a):
        return quack_gemm.gemm_add(c, a, weight, quack_gemm.tile("residual"))
    return lt.addmm(c, a, weight, cublaslt)


@torch.library.custom_op("paratron::embedding_accumulate", mutates_args=("main_grad",))
def embedding_accumulate(main_grad: Tensor, ids: Tensor, dy: Tensor) -> None:
    """``main_grad[ids[t]] += dy[t]`` for every token t (``ids`` [T], ``dy`` [T, h]): an embedding table's
    gradient. On CUDA outside --deterministic-mode one Triton pass of fp32 atomic adds (the order of the
    adds to a repeated token's row varies from run to run); elsewhere torch's embedding backward (sorted,
    deterministic) sums the rows first and the sum is added, as on the unfused path."""
    if (triton is not None and main_grad.is_cuda and main_grad.dtype == torch.float32 and dy.is_contiguous()
            and main_grad.is_contiguous() and not torch.are_deterministic_algorithms_enabled()):
        t, h = dy.shape
        with torch.cuda.device(main_grad.device):
            _embedding_accumulate[(t, triton.cdiv(h, EMB_BLOCK))](main_grad, ids, dy, h, BLOCK=EMB_BLOCK)
        return
    grad = torch.ops.aten.embedding_dense_backward(dy, ids, main_grad.size(0), -1, False)
    accumulate_(main_grad, grad, write=False)


@embedding_accumulate.register_fake
def _embedding_accumulate_fake(main_grad, ids, dy):
    return None


EMB_BLOCK = 1024  # columns per program of the embedding's accumulation


if triton is not None:
    @triton.jit
    def _embedding_accumulate(acc_ptr, ids_ptr, dy_ptr, h, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        row = tl.load(ids_ptr + t).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < h
        g = tl.load(dy_ptr + t.to(tl.int64) * h + offs, mask=mask).to(tl.float32)
        tl.atomic_add(acc_ptr + row * h + offs, g, mask=mask, sem="relaxed")

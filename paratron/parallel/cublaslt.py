"""``out = C + A @ W^T`` into a new tensor by cuBLASLt, which reads C and writes D separately (bf16, CUDA).

torch's ``addmm(C, A, W^T)`` copies C into its output and then runs a GEMM that accumulates into it: a
device-to-device copy of the residual stream before fc2's GEMM in every layer (2.8 ms per 65,536 tokens on
llama-1b, 32 copies; benchmarks/results/profile_kernels_llama-1b_mb16x2_6d8b1bf.tsv). cuBLASLt's matmul takes C
and D as two matrices, so the copy is not needed; torch does not expose that form. This module calls the eight
cuBLASLt functions it needs through ctypes on the library torch itself has loaded (no build step, no other
dependency; nvmath-python has bindings for the same API, but its import brings cuda-core of a pinned range and its
FFT and sparse modules to the device for one call). Descriptors, the chosen algorithm and a workspace are made
once per shape and device; the first call of a shape times the heuristic's first CANDIDATES algorithms on its
operands and keeps the fastest (cuBLASLt's own order is not the fastest at every shape).

Measured on an H100 at its power limit (benchmarks/results/gemm_power_residual_20261126_1633.md, 32,768 tokens):
llama-1b's output projection + residual (K 2048) 590 TFLOP/s against 528 for addmm with its copy and 579 for
quack's GEMM reading C (quack_gemm.py), fc2 + residual (K 8192) 662 against 652; in the training step
(train_throughput_llama-1b_20261126_163313.md) fc2 on cuBLASLt +0.33 %, the output projection too +0.38 % more.

``addmm`` is a torch custom op (one opaque node for compiled graphs). It runs cuBLASLt on CUDA bf16 tensors
whose rows are contiguous and 16-byte aligned and falls back to torch's addmm elsewhere (CPUs, other dtypes, a
library or status error: the error is then reported once as a warning).
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings

import torch
from torch import Tensor

# cuBLASLt / CUDA constants (cublasLt.h, library_types.h, cublas_api.h)
_COMPUTE_32F, _R_32F, _R_16BF = 68, 0, 14
_DESC_TRANSA, _DESC_TRANSB, _PREF_MAX_WORKSPACE = 3, 4, 1
_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
CANDIDATES = 8  # algorithms asked of the heuristic; the first call of a shape times them and keeps the fastest
ENABLED = os.environ.get("PARATRON_CUBLASLT", "1") != "0"  # 0: torch's addmm (read once, like the other switches)


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.lru_cache(maxsize=None)
def _lib():
    """The cuBLASLt library torch loaded (found in this process's mappings after a CUDA matmul)."""
    torch.ones(8, 8, device="cuda").matmul(torch.ones(8, 8, device="cuda"))  # makes torch load cuBLAS(Lt)
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    lib = ctypes.CDLL(sorted(paths)[0])
    for name in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                 "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
                 "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} returned status {status}")


def _new(create, *args) -> ctypes.c_void_p:
    """A cuBLASLt object made by ``create(&handle, *args)``."""
    handle = ctypes.c_void_p()
    _check(create(ctypes.byref(handle), *args), create.__name__)
    return handle


@functools.lru_cache(maxsize=None)
def _handle(device: int) -> ctypes.c_void_p:
    return _new(_lib().cublasLtCreate)


@functools.lru_cache(maxsize=None)
def _workspace(device: int) -> Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")


@functools.lru_cache(maxsize=None)
def _plan(device: int, m: int, n: int, k: int, lda: int, ldw: int, ldc: int, ldd: int, w_rows: bool = True):
    """A ``_Plan`` for D [m, n] = C + A [m, k] @ W [n, k]^T, bf16 with row strides lda / ldc / ldd; W row-major
    with row stride ldw (``w_rows``), or the transpose of a row-major [k, n] with row stride ldw. cuBLASLt is
    column-major: it computes D^T = W A^T."""
    lib = _lib()
    desc = _new(lib.cublasLtMatmulDescCreate, ctypes.c_int(_COMPUTE_32F), ctypes.c_int(_R_32F))
    for attr, op in ((_DESC_TRANSA, _OP_T if w_rows else _OP_N), (_DESC_TRANSB, _OP_N)):
        value = ctypes.c_int(op)
        _check(lib.cublasLtMatmulDescSetAttribute(desc, ctypes.c_int(attr), ctypes.byref(value),
                                                  ctypes.c_size_t(4)), "MatmulDescSetAttribute")
    layouts = [_new(lib.cublasLtMatrixLayoutCreate, ctypes.c_int(_R_16BF), ctypes.c_uint64(rows),
                    ctypes.c_uint64(cols), ctypes.c_int64(ld))
               for rows, cols, ld in ((k, n, ldw) if w_rows else (n, k, ldw), (k, m, lda), (n, m, ldc), (n, m, ldd))]
    pref = _new(lib.cublasLtMatmulPreferenceCreate)
    size = ctypes.c_uint64(WORKSPACE_BYTES)
    _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, ctypes.c_int(_PREF_MAX_WORKSPACE), ctypes.byref(size),
                                                    ctypes.c_size_t(8)), "MatmulPreferenceSetAttribute")
    results, count = (_Heuristic * CANDIDATES)(), ctypes.c_int(0)
    _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(device), desc, *layouts, pref, ctypes.c_int(CANDIDATES),
                                              results, ctypes.byref(count)), "MatmulAlgoGetHeuristic")
    found = [r for r in results[:count.value] if r.state == 0 and r.workspace_size <= WORKSPACE_BYTES]
    if not found:
        raise RuntimeError(f"cuBLASLt found no algorithm for [{m}, {k}] x [{k}, {n}]")
    return _Plan(desc, layouts, found)


class _Plan:
    """One shape's descriptors, the heuristic's candidate algorithms, and (after the first call) the fastest."""

    def __init__(self, desc, layouts, candidates):
        self.desc, self.layouts, self.candidates = desc, layouts, candidates
        self.best = candidates[0] if len(candidates) == 1 else None


def _runs(c: Tensor, a: Tensor, w: Tensor) -> bool:
    """cuBLASLt takes these: CUDA bf16 2-D, rows contiguous, row strides and pointers 16-byte aligned."""
    return all(t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1
               and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in (c, a, w))


def _matmul(plan: _Plan, algo: _Heuristic, device: int, c: Tensor, a: Tensor, w: Tensor, out: Tensor,
            beta: float = 1.0) -> None:
    lw, la, lc, ld = plan.layouts
    one, beta = ctypes.c_float(1.0), ctypes.c_float(beta)
    with torch.cuda.device(device):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(_lib().cublasLtMatmul(
        _handle(device), plan.desc, ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), lw,
        ctypes.c_void_p(a.data_ptr()), la, ctypes.byref(beta), ctypes.c_void_p(c.data_ptr()), lc,
        ctypes.c_void_p(out.data_ptr()), ld, ctypes.byref(algo.algo), ctypes.c_void_p(_workspace(device).data_ptr()),
        ctypes.c_size_t(WORKSPACE_BYTES), stream), "Matmul")


def _fastest(plan: _Plan, device: int, *operands: Tensor) -> _Heuristic:
    """The candidate algorithm that ran fastest on these operands (CUDA events, best of 3 after a warm-up)."""
    times = []
    for algo in plan.candidates:
        _matmul(plan, algo, device, *operands)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        for e in events[1:]:
            _matmul(plan, algo, device, *operands)
            e.record()
        events[-1].synchronize()
        times.append(min(a.elapsed_time(b) for a, b in zip(events, events[1:])))
    return plan.candidates[times.index(min(times))]


def _lt_addmm(c: Tensor, a: Tensor, w: Tensor) -> Tensor:
    (m, k), n = a.shape, w.size(0)
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    plan = _plan(device, m, n, k, a.stride(0), w.stride(0), c.stride(0), n)
    if plan.best is None:  # first call of this shape: time the heuristic's candidates (not while capturing)
        if torch.cuda.is_current_stream_capturing():
            _matmul(plan, plan.candidates[0], device, c, a, w, out)
            return out
        plan.best = _fastest(plan, device, c, a, w, out)
    _matmul(plan, plan.best, device, c, a, w, out)
    return out


@torch.library.custom_op("paratron::cublaslt_addmm", mutates_args=())
def addmm(c: Tensor, a: Tensor, w: Tensor) -> Tensor:
    """``c + a @ w^T`` (``a`` [M, K], ``w`` [N, K], ``c`` [M, N]) into a new tensor: cuBLASLt reading C and
    writing the output separately where it runs (see the module's note), torch's addmm elsewhere."""
    if not ENABLED or c.shape != (a.size(0), w.size(0)) or a.size(1) != w.size(1) or not _runs(c, a, w):
        return torch.addmm(c, a, w.t())
    try:
        return _lt_addmm(c, a, w)
    except (RuntimeError, OSError, AttributeError) as e:
        _warn_once(f"{type(e).__name__}: {e}")
        return torch.addmm(c, a, w.t())


@addmm.register_fake
def _addmm_fake(c, a, w):
    return a.new_empty(a.size(0), w.size(0))


def _setup(ctx, inputs, output) -> None:
    c, a, w = inputs
    ctx.save_for_backward(a, w)


def _backward(ctx, grad):
    a, w = ctx.saved_tensors
    return grad, grad @ w, grad.t() @ a


addmm.register_autograd(_backward, setup_context=_setup)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(f"cuBLASLt addmm: {message}; torch's addmm (with its copy of C) instead")

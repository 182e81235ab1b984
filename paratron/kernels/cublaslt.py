"""cuBLASLt's GEMMs through ctypes (bf16, CUDA): ``C + A @ W^T`` into a new tensor, and ``A @ W^T`` by the faster
of cuBLAS and cuBLASLt's own candidates.

``addmm``. torch's ``addmm(C, A, W^T)`` copies C into its output and then runs a GEMM that accumulates into it:
a device-to-device copy of the residual stream before fc2's GEMM in every layer (one copy per layer and
micro-batch in llama-1b's step profile: benchmarks/results/profile_kernels_llama-1b_mb16x2_6d8b1bf.tsv). cuBLASLt's
matmul takes C and D as two matrices, so the copy is not needed; torch does not expose that form.

``mm``. cuBLAS runs the first algorithm of its heuristic; at some of the step's shapes another of the
heuristic's candidates is faster at the H100's power limit: the output layer's logits, the output projection's
input gradient and the QKV input gradient; elsewhere cuBLAS's own pick is as fast or faster
(benchmarks/results/gemm_power_lt_3a54ff2.md).

Both time, at the first call of each shape, torch's own call and the heuristic's first CANDIDATES algorithms on
the call's operands, and keep the fastest (so never slower than torch's call, up to the timing's noise); they
time them again at the shape's RETUNE_AT-th call: the first call's GPU is not yet at the clock it holds in a
training run (at the power limit the order changes: the logits' fastest candidate there was not the first
call's pick, benchmarks/results/profile_kernels_llama-1b_mb16x2_ead243b.tsv). The
module calls the eight cuBLASLt functions it needs through ctypes on the library torch itself has loaded (no
build step, no other dependency; nvmath-python has bindings for the same API, but its import brings cuda-core of
a pinned range and its FFT and sparse modules to the device for a few calls). Descriptors, candidates and the
choice are kept per shape and device, with one workspace per device.

Measured on an H100 at its power limit with llama-1b's shapes: the output projection + residual (K 2048) on
cuBLASLt is faster than addmm with its copy and than quack's GEMM reading C (quack_gemm.py), and fc2 + residual
(K 8192) faster than addmm (benchmarks/results/gemm_power_residual_20261126_1633.md); in the training step, measured in
one command, fc2 on cuBLASLt and then the output projection too each gave a small gain
(benchmarks/results/train_throughput_llama-1b_20261126_163313.md).

The ops are torch custom ops (one opaque node for compiled graphs, with autograd formulas). They run torch's
call on CPUs, other dtypes, operands cuBLASLt is not given (see ``_runs``), with ``enabled`` False (the
``--kernel-cublaslt`` switch), under torch's deterministic algorithms (``--deterministic-mode``: the timed
choice of algorithm could differ from run to run), and
after a library or status error (reported once as a warning).
"""
from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Optional

import torch
from torch import Tensor

# cuBLASLt / CUDA constants (cublasLt.h, library_types.h, cublas_api.h)
_COMPUTE_32F, _R_32F, _R_16BF = 68, 0, 14
_DESC_TRANSA, _DESC_TRANSB, _PREF_MAX_WORKSPACE = 3, 4, 1
_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
CANDIDATES = 8  # algorithms asked of the heuristic; the first call of a shape times them and keeps the fastest
MAX_PLANS = 64  # shapes planned at most (see _plan)
RETUNE_AT = 8  # ... and its RETUNE_AT-th call again, the GPU then at its steady clock (in training: its power limit)
TIMING_ROUNDS = 3  # rounds over the choices when timing them (see _fastest)


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
def _plan(device: int, m: int, n: int, k: int, lda: int, ldw: int, ldc: int, w_rows: bool = True,
          plain: bool = False):
    """A ``_Plan`` for D [m, n] (a new, contiguous tensor) = C + A [m, k] @ W [n, k]^T, bf16, A and C with row
    strides lda / ldc; W row-major with row stride ldw (``w_rows``), or the transpose of a row-major [k, n] with
    row stride ldw. cuBLASLt is column-major: it computes D^T = W A^T. ``plain``: for ``mm`` (no C; its own plan
    and choice). Past MAX_PLANS shapes ``_Full`` (each new shape costs descriptors and two timings: a run whose
    shapes keep changing stays on torch's calls for the rest)."""
    if _plan.cache_info().currsize >= MAX_PLANS:
        raise _Full
    lib = _lib()
    desc = _new(lib.cublasLtMatmulDescCreate, ctypes.c_int(_COMPUTE_32F), ctypes.c_int(_R_32F))
    for attr, op in ((_DESC_TRANSA, _OP_T if w_rows else _OP_N), (_DESC_TRANSB, _OP_N)):
        value = ctypes.c_int(op)
        _check(lib.cublasLtMatmulDescSetAttribute(desc, ctypes.c_int(attr), ctypes.byref(value),
                                                  ctypes.c_size_t(4)), "MatmulDescSetAttribute")
    layouts = [_new(lib.cublasLtMatrixLayoutCreate, ctypes.c_int(_R_16BF), ctypes.c_uint64(rows),
                    ctypes.c_uint64(cols), ctypes.c_int64(ld))
               for rows, cols, ld in ((k, n, ldw) if w_rows else (n, k, ldw), (k, m, lda), (n, m, ldc), (n, m, n))]
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


class _Full(Exception):
    """MAX_PLANS shapes planned already."""


class _Plan:
    """One shape's descriptors, the heuristic's candidate algorithms, and (after the first call) the fastest of
    them and torch's own call (``best``: an algorithm, or None for torch's)."""

    def __init__(self, desc, layouts, candidates):
        self.desc, self.layouts, self.candidates = desc, layouts, candidates
        self.calls, self.best = 0, None


def _runs(c: Optional[Tensor], a: Tensor, w: Tensor) -> bool:
    """cuBLASLt takes these: CUDA bf16 2-D, 16-byte aligned; A and C with contiguous rows, W with contiguous
    rows or columns; their strides multiples of 8 elements. Not under torch's deterministic algorithms
    (``--deterministic-mode``): the choice of algorithm is timed, so two runs could choose differently."""
    if torch.are_deterministic_algorithms_enabled():
        return False

    def fits(t: Tensor, major: int) -> bool:
        return (t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(major) == 1
                and t.stride(1 - major) % 8 == 0 and t.data_ptr() % 16 == 0)
    return fits(a, 1) and (c is None or fits(c, 1)) and (fits(w, 1) or fits(w, 0))


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


def _fastest(plan: _Plan, run) -> Optional[_Heuristic]:
    """The fastest of torch's call (None) and the candidate algorithms, ``run(choice)`` running one: TIMING_ROUNDS
    rounds over all the choices in turn, each choice a warm-up call and 3 timed (CUDA events) per round; a choice's
    time is the sum over the rounds of its median. Taking the rounds in turn spreads a drift of the clock (the GPU
    settling at its power limit) over every choice instead of charging it to the ones timed last."""
    choices = [None] + plan.candidates
    totals = [0.0] * len(choices)
    for _ in range(TIMING_ROUNDS):
        for i, choice in enumerate(choices):
            run(choice)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            events[0].record()
            for e in events[1:]:
                run(choice)
                e.record()
            events[-1].synchronize()
            totals[i] += sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))[1]
    return choices[totals.index(min(totals))]


def _lt(c: Optional[Tensor], a: Tensor, w: Tensor, torch_call) -> Tensor:
    """``c + a @ w^T`` (c None: ``a @ w^T``) into a new tensor by the fastest of ``torch_call(out)`` and cuBLASLt's
    candidates, timed at the first call of each shape (not while a CUDA graph is captured: cuBLASLt's first)."""
    (m, k), n = a.shape, w.size(0)
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    w_rows = w.stride(1) == 1
    c_, beta = (out, 0.0) if c is None else (c, 1.0)
    plan = _plan(device, m, n, k, a.stride(0), w.stride(0 if w_rows else 1), c_.stride(0), w_rows, c is None)

    def run(choice):
        if choice is None:  # (into ``out`` too: timing the choices allocates nothing more)
            return torch_call(out)
        _matmul(plan, choice, device, c_, a, w, out, beta)
        return out
    plan.calls += 1
    if plan.calls in (1, RETUNE_AT) and not torch.cuda.is_current_stream_capturing():
        plan.best = _fastest(plan, run)
    elif plan.calls == 1:  # (capturing a CUDA graph: cuBLASLt's first candidate, timed at the next call)
        plan.calls = 0
        return run(plan.candidates[0])
    return run(plan.best)


@torch.library.custom_op("paratron::cublaslt_addmm", mutates_args=())
def addmm(c: Tensor, a: Tensor, w: Tensor, enabled: bool = True) -> Tensor:
    """``c + a @ w^T`` (``a`` [M, K], ``w`` [N, K], ``c`` [M, N]) into a new tensor: cuBLASLt reading C and
    writing the output separately where it runs and is faster (see the module's note), else torch's addmm.
    ``enabled``: the ``--kernel-cublaslt`` switch (False: torch's addmm)."""
    if not enabled or c.shape != (a.size(0), w.size(0)) or a.size(1) != w.size(1) or not _runs(c, a, w):
        return torch.addmm(c, a, w.t())
    try:
        return _lt(c, a, w, lambda out: torch.addmm(c, a, w.t(), out=out))
    except _Full:
        return torch.addmm(c, a, w.t())
    except (RuntimeError, OSError, AttributeError) as e:
        _warn_once(f"{type(e).__name__}: {e}")
        return torch.addmm(c, a, w.t())


@addmm.register_fake
def _addmm_fake(c, a, w, enabled=True):
    return a.new_empty(a.size(0), w.size(0))


@torch.library.custom_op("paratron::cublaslt_mm", mutates_args=())
def mm(a: Tensor, w: Tensor, enabled: bool = True) -> Tensor:
    """``a @ w^T`` (``a`` [M, K], ``w`` [N, K] with rows or columns contiguous) into a new tensor by the faster
    of torch's mm and cuBLASLt's candidates for its shape (timed at the first call of each shape); ``enabled``:
    the ``--kernel-cublaslt`` switch (False: torch's mm)."""
    if not enabled or a.size(1) != w.size(1) or not _runs(None, a, w):
        return torch.mm(a, w.t())
    try:
        return _lt(None, a, w, lambda out: torch.mm(a, w.t(), out=out))
    except _Full:
        return torch.mm(a, w.t())
    except (RuntimeError, OSError, AttributeError) as e:
        _warn_once(f"{type(e).__name__}: {e}")
        return torch.mm(a, w.t())


@mm.register_fake
def _mm_fake(a, w, enabled=True):
    return a.new_empty(a.size(0), w.size(0))


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[-3:-1])  # a, w (the last input is the switch)


def _addmm_backward(ctx, grad):
    a, w = ctx.saved_tensors
    return grad, grad @ w, grad.t() @ a, None


def _mm_backward(ctx, grad):
    a, w = ctx.saved_tensors
    return grad @ w, grad.t() @ a, None


addmm.register_autograd(_addmm_backward, setup_context=_setup)
mm.register_autograd(_mm_backward, setup_context=_setup)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(f"cuBLASLt: {message}; torch's matmul instead")

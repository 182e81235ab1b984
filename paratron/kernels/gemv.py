"""Decode steps' linear layers at 1..8 rows as one Triton kernel streaming the weights (GEMV; fc1's SwiGLU fused).

``y = x W^T (+ b) (+ residual)``, or fc1's gated output ``silu(x Wg^T) * (x Wu^T)`` from its fused ``[gate; up]``
weight.

At batch 1..8 a linear layer reads its whole weight to produce a handful of outputs: its speed is the speed
at which the weight leaves HBM. Each program here reads a contiguous block of ``BLOCK_N`` weight rows,
``BLOCK_K`` columns at a time (wide loads along the contiguous K, software-pipelined by ``num_stages``), and
multiplies them with the rows of ``x`` (padded to 16 rows, one ``tl.dot`` on tf32 operands, which hold bf16
and fp16 exactly: the tensor cores do the reduction, the padding costs no memory traffic). When the weight has few rows (the attention's output
projection, fc2) there are too few row blocks to fill the GPU, so K is split over ``split_k`` programs per
block: they add their fp32 partial sums into a workspace with atomics, and the last one to arrive (a counter
per block) takes the sums out, resetting the workspace as it reads it, and writes the output. fp32
accumulation throughout; bf16 (or fp16) in and out. The block shapes are tuned per (m, n, k, split) by
``triton.autotune`` over ``CONFIGS``.

One row (a batch-1 decode step) goes to ``kernels/gemv_row.py`` instead, where the layer's norms and SwiGLU are fused
too. Measured slower than the Inductor reductions it replaces on an H200 (docs/inference.md), so
``--kernel-decode-gemv auto`` keeps torch (``F.linear``, which the compiled decode step turns into Inductor's
reductions).

:func:`linear_reference` and :func:`swiglu_reference` are the torch expressions it replaces; they run on CPUs
(the custom op's CPU kernel), and the tests compare the kernel with them (on CPU through Triton's
interpreter, via :func:`launch`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import gemv_row

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 8  # the kernel serves at most this many rows of x (decode steps of batch <= 8)
BLOCK_M = 16  # x's rows padded to tl.dot's smallest tile
MIN_BLOCK_N = 16  # the smallest BLOCK_N of CONFIGS: the split-K counters are allocated for it
NOMINAL_BLOCK_N = 32  # the row block split_k counts with (the tuned one may differ)
MIN_SPLIT_COLUMNS = 512  # K is split no finer than this many columns per program
DTYPES = (torch.bfloat16, torch.float16)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T + b + residual``: what the kernel computes, in torch."""
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def swiglu_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(x Wg^T) * (x Wu^T)`` of a fused weight ``[Wg; Wu]`` (fc1 of the gated MLP: gate rows first)."""
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether the kernel takes this product: Triton and CUDA, 1..MAX_ROWS rows, bf16 / fp16 throughout, a weight
    with contiguous rows."""
    k = x.size(-1)
    rows = x.numel() // k if k else 0
    return (triton is not None and x.is_cuda and weight.is_cuda and 1 <= rows <= MAX_ROWS
            and x.dtype in DTYPES and weight.dtype == x.dtype and weight.dim() == 2 and weight.size(1) == k
            and weight.is_contiguous() and (bias is None or bias.dtype == x.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T + b + residual`` over x's last dim: the kernel where it ``applies``, else the reference."""
    if not applies(x, weight, bias) or (residual is not None and residual.dtype != x.dtype):
        return linear_reference(x, weight, bias, residual)
    if bias is None and gemv_row.applies(x, weight):  # one row: the row kernel
        return gemv_row.linear(x, weight, residual=residual)
    rows = x.reshape(-1, x.size(-1))
    res = None if residual is None else residual.reshape(rows.size(0), weight.size(0))
    y = torch.ops.paratron.gemv(rows, weight, bias, res, False)
    return y.view(*x.shape[:-1], weight.size(0))


def swiglu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(x Wg^T) * (x Wu^T)`` of fc1's fused ``[Wg; Wu]``: the kernel where it ``applies``, else the
    reference."""
    if not applies(x, weight, bias) or weight.size(0) % 2:
        return swiglu_reference(x, weight, bias)
    if bias is None and gemv_row.applies(x, weight):
        return gemv_row.linear(x, weight, gated=True)
    y = torch.ops.paratron.gemv(x.reshape(-1, x.size(-1)), weight, bias, None, True)
    return y.view(*x.shape[:-1], weight.size(0) // 2)


def split_k(n: int, k: int, sms: int) -> int:
    """Programs per row block along K: doubled while the row blocks times the splits fill fewer than two
    programs per SM and each split keeps at least MIN_SPLIT_COLUMNS columns."""
    split, blocks = 1, -(-n // NOMINAL_BLOCK_N)
    while blocks * split < 2 * sms and k // (2 * split) >= MIN_SPLIT_COLUMNS:
        split *= 2
    return split


def _out_rows(weight: torch.Tensor, gated: bool) -> int:
    return weight.size(0) // 2 if gated else weight.size(0)


if triton is not None:
    # (BLOCK_N, BLOCK_K, warps, stages): row blocks of 16..64 rows, 128..512 columns per load, 3-4 loads in flight
    CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
               for bn, bk, w, s in ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 4),
                                    (64, 128, 4, 3), (64, 256, 8, 3))]

    @triton.jit
    def _finish(acc, acc_u, b_ptr, r_ptr, out_ptr, rm, rn, ok, N, sr, so,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr):
        """The output block from its fp32 sums: bias, the gate (silu(gate) * up), the residual, one store."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y = acc
        if GATED:
            y = acc * tl.sigmoid(acc) * acc_u
        if HAS_RES:
            y += tl.load(r_ptr + rm[:, None] * sr + rn[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[:, None] * so + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, sx, sr, so,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (i, j): output columns [i BLOCK_N, (i+1) BLOCK_N) over the j-th of SPLIT_K spans of K. W is
        contiguous [N (x2 gated: gate rows, then up rows), K]; x [M, K] with row stride sx."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        start = pid_k * span
        stop = tl.minimum(start + span, K)
        row_ok, m_ok = rn < N, rm < M
        w_rows = w_ptr + rn[:, None].to(tl.int64) * K
        u_rows = w_ptr + (rn[:, None] + N).to(tl.int64) * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(start, stop, BLOCK_K):
            ks = k0 + rk
            k_ok = ks < K
            xt = tl.load(x_ptr + rm[:, None] * sx + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            xt = xt.to(tl.float32)  # (tf32 operands hold bf16 / fp16 exactly; the MMA's speed is not the limit)
            acc = tl.dot(xt, tl.trans(wt.to(tl.float32)), acc, input_precision="tf32")
            if GATED:
                wu = tl.load(u_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                acc_u = tl.dot(xt, tl.trans(wu.to(tl.float32)), acc_u, input_precision="tf32")
        ok = m_ok[:, None] & row_ok[None, :]
        if SPLIT_K == 1:
            _finish(acc, acc_u, b_ptr, r_ptr, out_ptr, rm, rn, ok, N, sr, so, HAS_BIAS, HAS_RES, GATED)
        else:
            offs = rm[:, None] * N + rn[None, :]  # the workspace: [M, N] fp32 (gated: the gate's, then the up's)
            tl.atomic_add(ws_ptr + offs, acc, mask=ok, sem="relaxed")
            if GATED:
                tl.atomic_add(ws_ptr + M * N + offs, acc_u, mask=ok, sem="relaxed")
            tl.debug_barrier()  # every thread's partial sums issued before the counter's release
            if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:  # the last span of this block
                # the sums read where the atomics left them (L2), and the workspace reset for the next launch
                acc = tl.atomic_add(ws_ptr + offs, tl.zeros_like(acc), mask=ok, sem="relaxed")
                tl.store(ws_ptr + offs, tl.zeros_like(acc), mask=ok)
                if GATED:
                    acc_u = tl.atomic_add(ws_ptr + M * N + offs, tl.zeros_like(acc_u), mask=ok, sem="relaxed")
                    tl.store(ws_ptr + M * N + offs, tl.zeros_like(acc_u), mask=ok)
                tl.store(cnt_ptr + pid_n, 0)
                _finish(acc, acc_u, b_ptr, r_ptr, out_ptr, rm, rn, ok, N, sr, so, HAS_BIAS, HAS_RES, GATED)

    _gemv_tuned = triton.autotune(configs=CONFIGS, key=["M", "N", "K", "SPLIT_K", "GATED"])(_gemv_kernel)

    def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
               gated: bool, split: Optional[int] = None, config: Optional[dict] = None) -> torch.Tensor:
        """The kernel on x [m, k] (m <= 16, unit column stride) and a contiguous weight: [m, n] in x's dtype.
        ``split``: K's split (default ``split_k`` for this GPU); ``config``: BLOCK_N, BLOCK_K (and num_warps,
        num_stages) instead of the tuned choice (the interpreter tests run each of CONFIGS)."""
        m, k = x.shape
        n = _out_rows(weight, gated)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if split is None:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
            split = split_k(n, k, sms)
        # one zeroed buffer: the fp32 workspace (its zero bits are 0.0) and the int32 counters; left zeroed by the
        # kernel, so the autotuner's repeated launches find it as the first did
        width = (2 if gated else 1) * m * n
        buf = torch.zeros(width + -(-n // MIN_BLOCK_N) if split > 1 else 1, dtype=torch.int32, device=x.device)
        ws, cnt = (buf[:width].view(torch.float32), buf[width:]) if split > 1 else (buf.view(torch.float32), buf)
        args = (x, weight, bias if bias is not None else x, residual if residual is not None else x, out, ws, cnt,
                m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0))
        flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, GATED=gated, SPLIT_K=split,
                     BLOCK_M=BLOCK_M)
        if config is None:
            _gemv_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)](*args, **flags)
        else:
            _gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]), split)](*args, **flags, **config)
        return out

    @torch.library.custom_op("paratron::gemv", mutates_args=(), device_types="cuda")
    def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: Optional[torch.Tensor], gated: bool) -> torch.Tensor:
        with torch.cuda.device(x.device):
            return launch(x, weight, bias, residual, gated)
else:  # the op without Triton: its CPU kernel below is all there is
    @torch.library.custom_op("paratron::gemv", mutates_args=(), device_types="cuda")
    def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: Optional[torch.Tensor], gated: bool) -> torch.Tensor:
        return _reference_op(x, weight, bias, residual, gated)


def _reference_op(x, weight, bias, residual, gated):
    """The op in torch: x [m, k] -> [m, n] (the CPU kernel, and CUDA without Triton)."""
    return swiglu_reference(x, weight, bias) if gated else linear_reference(x, weight, bias, residual)


_gemv_op.register_kernel("cpu")(_reference_op)


@_gemv_op.register_fake
def _(x, weight, bias, residual, gated):
    return x.new_empty(x.size(0), _out_rows(weight, gated))

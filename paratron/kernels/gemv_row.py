"""A one-row decode step's linear layers, each with its neighbours, as one Triton kernel streaming the weights.

``out = [residual +] act(norm(x) W^T)`` for a single row ``x`` [K]: the RMSNorm before the layer (optional, its
statistics recomputed by every program from x, which L2 holds), the weight streamed from HBM, fc1's SwiGLU (a fused
``[gate; up]`` weight: a program reads the gate's rows and the matching up rows) or the residual added after it.
A transformer layer of a batch-1 decode step is then four of these and the fused attention
(``model/transformer.py: TransformerLayer.decode_row``; ``--kernel-decode-gemv``, auto at one row on CUDA): qkv with
the attention's norm (and a Qwen2-style qkv bias), the output projection with the residual, fc1 with the MLP's norm
and SwiGLU, fc2 with the residual; where Inductor's reductions take about nine kernels a layer (split reductions and
their second passes, the norms, SwiGLU).

Each program owns ``BLOCK_N`` output rows over all of K (no split, no workspace to zero, no second pass) and walks K
``BLOCK_K`` columns at a time, loading the next block of weight rows while it multiplies the current one (two blocks
in flight a program, the first requested before the norm's statistics are computed; launched early, three, the first
two requested before the wait and every weight load marked evict_first: ``early_config``). The products are kept
per column in fp32 and summed once at the end. The rounding follows the model's torch expressions: the normalised
row is rounded to the model's dtype, then times the norm's weight and rounded again (``model/norms.py``); the
product is rounded before SwiGLU or the residual add. With ``pdl`` (``--kernel-decode-pdl``) the kernel is launched
for programmatic dependent launch and waits for the kernel before it only after its first weight block is requested:
the weights do not depend on the previous kernel, the row does.

:func:`row_reference` is the torch expression (the op's CPU kernel); the tests compare the kernel with it (on CPU
through Triton's interpreter, via :func:`launch`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .hardware import early_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

DTYPES = (torch.bfloat16, torch.float16)


def row_reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
                  residual: Optional[torch.Tensor] = None, gated: bool = False, eps: float = 1e-5,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[residual +] act(norm(x) W^T [+ bias])`` in torch, over x's last dimension: the model's RMSNorm with
    ``norm_weight`` (none without), ``gated``: SwiGLU of the fused ``[gate; up]`` product; ``bias``: the layer's (a
    Qwen2-style qkv projection's), added to the product before it is rounded, as ``F.linear`` does."""
    if norm_weight is not None:
        x = norm_weight * F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)
    y = F.linear(x, weight, bias)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this product: Triton and CUDA, one row of unit stride, bf16 / fp16 throughout, a
    contiguous weight."""
    k = x.size(-1)
    return (triton is not None and x.is_cuda and weight.is_cuda and x.numel() == k and x.stride(-1) == 1
            and x.dtype in DTYPES and weight.dtype == x.dtype and weight.dim() == 2 and weight.size(1) == k
            and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None, gated: bool = False, eps: float = 1e-5,
           pdl: bool = False, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`row_reference` of a one-row ``x`` [..., K] by the kernel where it ``applies``, else by torch; the
    result has x's leading dimensions."""
    loose = any(t is not None and (t.stride(-1) != 1 or t.dtype != x.dtype) for t in (norm_weight, residual, bias))
    if not applies(x, weight) or loose:
        return row_reference(x, weight, norm_weight, residual, gated, eps, bias)
    n = weight.size(0) // 2 if gated else weight.size(0)
    res = None if residual is None else residual.reshape(1, n)
    y = torch.ops.paratron.gemv_row(x.reshape(1, -1), weight, norm_weight, res, gated, eps, pdl, bias)
    return y.view(*x.shape[:-1], n)


if triton is not None:
    # (BLOCK_N, BLOCK_K, warps): a few rows a program and many programs a streaming multiprocessor
    CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
               for bn, bk, w in ((1, 2048, 4), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 4), (4, 1024, 8),
                                 (8, 256, 4), (8, 512, 4), (16, 256, 4))]

    def early_config(n: int, k: int) -> dict:
        """The block shape of a kernel launched early (PDL): four rows a program, up to 1,024 columns a step, eight
        warps where the layer has at most 2,048 output rows (fewer programs, each keeping more loads in flight),
        else four. The autotuner times each kernel alone, where it cannot see the launches overlap; at llama-1b's
        five shapes, each in a chain of early launches, this rule gave the fastest of the tuned shapes, where the
        autotuner's picks were up to 7 % slower (benchmarks/results/decode_walk_rows_h100_20261206.md). Two weight
        blocks requested ahead, both before the wait, the loads marked evict_first (read once: L2 keeps the rows,
        the KV cache and the next kernel's early blocks): faster on H100s
        (benchmarks/results/decode_row_evict_h100_20261207.md)."""
        return {"BLOCK_N": 4, "BLOCK_K": min(1024, triton.next_power_of_2(k)), "num_warps": 8 if n <= 2048 else 4,
                "AHEAD": 2, "POLICY": "evict_first"}

    @triton.jit
    def _rounded(acc, b_ptr, rows, ok, HAS_BIAS: tl.constexpr, dt: tl.constexpr):
        """The row sums of ``acc`` [+ the bias at ``b_ptr + rows``, added before the rounding, as F.linear's],
        rounded to ``dt`` (kept in fp32)."""
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        return y.to(dt).to(tl.float32)

    @triton.jit
    def _pair(w_rows, u_rows, at, mask, GATED: tl.constexpr, POLICY: tl.constexpr):
        """The weight block at offsets ``at`` of the rows, and of the up rows where ``GATED`` (else the same block)."""
        w = tl.load(w_rows + at, mask=mask, other=0.0, eviction_policy=POLICY)
        u = w
        if GATED:
            u = tl.load(u_rows + at, mask=mask, other=0.0, eviction_policy=POLICY)
        return w, u

    @triton.jit
    def _rstd(x_ptr, K, eps, rk, BLOCK_K: tl.constexpr):
        """The RMSNorm statistic 1 / sqrt(mean(x^2) + eps) of the row x [K], ``BLOCK_K`` columns at a time."""
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            squares += xs * xs
        return tl.rsqrt(tl.sum(squares, 0) / K + eps)

    @triton.jit
    def _row_values(x_ptr, w_ptr, g_ptr, r_ptr, b_ptr, N, K, eps, pid, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                    GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, AHEAD: tl.constexpr, POLICY: tl.constexpr):
        """(rows, which are live, their values in fp32 rounded to x's dtype) of program ``pid`` of
        :func:`_row_kernel` (its docstring), before the store."""
        dt = x_ptr.dtype.element_ty
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        w_rows = w_ptr + rn[:, None].to(tl.int64) * K
        u_rows = w_ptr + (rn[:, None] + N).to(tl.int64) * K
        w, u = _pair(w_rows, u_rows, rk[None, :], n_ok[:, None] & (rk < K)[None, :], GATED, POLICY)
        if AHEAD == 2:  # the block after the first, also requested before the wait
            w1, u1 = _pair(w_rows + BLOCK_K, u_rows + BLOCK_K, rk[None, :], n_ok[:, None] & (rk + BLOCK_K < K)[None, :],
                           GATED, POLICY)
        if PDL:  # the weights never depend on the kernel before; the row does
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rstd = 1.0
        if NORM:
            rstd = _rstd(x_ptr, K, eps, rk, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            k_ok = ks < K
            w_next, u_next = _pair(w_rows + AHEAD * BLOCK_K, u_rows + AHEAD * BLOCK_K, ks[None, :],
                                   n_ok[:, None] & (ks + AHEAD * BLOCK_K < K)[None, :], GATED, POLICY)
            xk = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
            if NORM:
                gk = tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                xk = ((xk.to(tl.float32) * rstd).to(dt).to(tl.float32) * gk).to(dt)
            xf = xk.to(tl.float32)[None, :]
            acc += w.to(tl.float32) * xf
            if GATED:
                acc_u += u.to(tl.float32) * xf
            if AHEAD == 2:
                w, u, w1, u1 = w1, u1, w_next, u_next
            else:
                w, u = w_next, u_next
        y = _rounded(acc, b_ptr, rn, n_ok, HAS_BIAS, dt)
        if GATED:
            up = _rounded(acc_u, b_ptr, rn + N, n_ok, HAS_BIAS, dt)
            y = (y * tl.sigmoid(y)).to(dt).to(tl.float32) * up
        if HAS_RES:
            y = y.to(dt).to(tl.float32) + tl.load(r_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        return rn, n_ok, y

    @triton.jit
    def _row_kernel(x_ptr, w_ptr, g_ptr, r_ptr, b_ptr, out_ptr, N, K, eps, NORM: tl.constexpr,
                    HAS_RES: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr = False, AHEAD: tl.constexpr = 1,
                    POLICY: tl.constexpr = ""):
        """Program i: output rows [i BLOCK_N, (i+1) BLOCK_N). W is contiguous [N (x2 gated: the gate's rows, then
        the up's), K]; x, the norm's weight g, the residual r and the bias b ([N], x2 gated) are contiguous rows.
        ``AHEAD`` (1 or 2): weight blocks requested ahead of the one multiplied, all of them before the PDL wait;
        ``POLICY``: the weight loads' L2 eviction hint ("evict_first": read once)."""
        rn, n_ok, y = _row_values(x_ptr, w_ptr, g_ptr, r_ptr, b_ptr, N, K, eps, tl.program_id(0), NORM, HAS_RES, GATED,
                                  PDL, BLOCK_N, BLOCK_K, HAS_BIAS, AHEAD, POLICY)
        tl.store(out_ptr + rn, y.to(x_ptr.dtype.element_ty), mask=n_ok)

    _row_tuned = triton.autotune(configs=CONFIGS, key=["N", "K", "NORM", "HAS_RES", "GATED", "HAS_BIAS"])(_row_kernel)

    def launch(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor],
               residual: Optional[torch.Tensor], gated: bool, eps: float, pdl: bool = False,
               config: Optional[dict] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The kernel on x [1, K] and a contiguous weight: [1, n] in x's dtype. ``config``: BLOCK_N, BLOCK_K (and
        num_warps) instead of :func:`early_config`'s (with ``pdl``) or the autotuner's (the interpreter tests run
        each of CONFIGS)."""
        k = x.size(-1)
        n = weight.size(0) // 2 if gated else weight.size(0)
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
        pdl = early_launch(pdl, x)
        args = (x, weight, norm_weight if norm_weight is not None else x, residual if residual is not None else x,
                bias if bias is not None else x, out, n, k, eps)
        flags = dict(NORM=norm_weight is not None, HAS_RES=residual is not None, GATED=gated, PDL=pdl,
                     HAS_BIAS=bias is not None, **({"launch_pdl": True} if pdl else {}))
        config = config or (early_config(n, k) if pdl else None)
        if config is None:
            _row_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
        else:
            _row_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](*args, **flags, **config)
        return out

    @torch.library.custom_op("paratron::gemv_row", mutates_args=(), device_types="cuda")
    def _row_op(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], gated: bool, eps: float, pdl: bool,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        with torch.cuda.device(x.device):
            return launch(x, weight, norm_weight, residual, gated, eps, pdl, bias=bias)
else:  # the op without Triton: its CPU kernel below is all there is
    @torch.library.custom_op("paratron::gemv_row", mutates_args=(), device_types="cuda")
    def _row_op(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], gated: bool, eps: float, pdl: bool,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return row_reference(x, weight, norm_weight, residual, gated, eps, bias)


@_row_op.register_kernel("cpu")
def _(x, weight, norm_weight, residual, gated, eps, pdl, bias=None):
    return row_reference(x, weight, norm_weight, residual, gated, eps, bias)


@_row_op.register_fake
def _(x, weight, norm_weight, residual, gated, eps, pdl, bias=None):
    return x.new_empty(1, weight.size(0) // 2 if gated else weight.size(0))

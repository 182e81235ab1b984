"""The cross-entropy kernels of the fused output layer (paratron/parallel/cross_entropy.py): one Triton pass
per row that computes the log-sum-exp, the loss and, in place, the gradient ``softmax - onehot(target)``; and
the row scaling ``(t.float() * g).to(t.dtype)`` of the backward in one pass. Their references are the
compiled torch passes of paratron/parallel/cross_entropy.py (``_ce_stats`` / ``_ce_grad``) and the torch
expression in ``row_scaled``.

The row pass walks each row in blocks keeping a running max and per-lane sums of exp (online-softmax style),
reads the target logit, writes lse and the loss (fp32), then walks the row again, last block first (those
blocks were read most recently, so mostly still in L2), writing the gradient rounded to the logits' dtype.
Its exp is the GPU's approximate one (``ex2.approx`` of x log2 e, a few fp32 units off libdevice's expf) when
``fast_exp`` is set (the ``--kernel-ce-fast-exp`` switch): with libdevice's the pass is bound by arithmetic
rather than memory. The row scaling keeps torch's roundings (the bf16 matmul result, one fp32 multiply, one
rounding), so its results are bit-identical to the expression.
"""
from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs
    triton = None

# Launch parameters: the cross-entropy reads a row in blocks of 8192 logits at 8 warps (the fastest of the
# measured blocks and warps with the approximate exp: benchmarks/results/ce_kernel_bench_56356ff.md); the
# row-scaling pass moves 2048 elements (one llama-1b hidden row) per program.
CE_BLOCK, CE_WARPS = 8192, 8
SCALE_BLOCK, SCALE_WARPS = 2048, 4
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _on_device(t: torch.Tensor):
    """The context a Triton launch on ``t`` needs: its CUDA device current (nothing for CPU tensors, which
    only Triton's interpreter runs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def fused_ce_(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0, block: int = CE_BLOCK,
              num_warps: int = CE_WARPS, fast: bool = True):
    """``_ce_stats`` and ``_ce_grad_`` of ``logits`` [n, v] (row-contiguous) in one Triton kernel (``_ce_fused``):
    returns (lse, loss) [n] fp32 and overwrites ``logits`` with softmax - onehot(target - vocab_start).
    ``fast``: the GPU's approximate exp instead of libdevice's."""
    n, v = logits.shape
    assert logits.stride(1) == 1 and target.shape == (n,), (logits.stride(), target.shape)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    loss = torch.empty_like(lse)
    if n:
        with _on_device(logits):
            _ce_fused[(n,)](logits, target, lse, loss, v, logits.stride(0), target.stride(0), vocab_start,
                            BLOCK=block, FAST=fast, num_warps=num_warps)
    return lse, loss


def row_scaled(t: torch.Tensor, g: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``(t * g).to(t.dtype)`` for ``t`` [n, h] and a per-row ``g`` [n, 1]: on CUDA (bf16/fp16 ``t``, fp32
    ``g``) one Triton pass, written over ``t`` with ``inplace``, with the same values (t widened exactly,
    one fp32 multiply, one round to nearest even); torch's expression elsewhere."""
    if not (triton is not None and t.is_cuda and t.dim() == 2 and t.is_contiguous() and t.size(0) > 0
            and t.dtype in (torch.bfloat16, torch.float16) and g.dtype == torch.float32 and g.shape == (t.size(0), 1)):
        return (t * g).to(t.dtype)
    return scale_rows(t, g, t if inplace else torch.empty(t.shape, dtype=t.dtype, device=t.device))


def scale_rows(t: torch.Tensor, g: torch.Tensor, out: torch.Tensor, block: int = SCALE_BLOCK,
               num_warps: int = SCALE_WARPS) -> torch.Tensor:
    """``out = (t.float() * g).to(out.dtype)`` by the Triton kernel (``t``, ``out``: [n, h] with unit column
    stride; ``g``: [n, 1] fp32, any row stride, 0 included)."""
    n, h = t.shape
    with _on_device(t):
        _scale_rows[(n, triton.cdiv(h, block))](t, g, out, h, t.stride(0), g.stride(0), out.stride(0),
                                                  BLOCK=block, num_warps=num_warps)
    return out


if triton is not None:
    # exp and log as CUDA computes them (``_expf`` without FAST, and the lse's log): the compiled passes call
    # libdevice's exp (Inductor's default, without fast math) and torch's logf is libdevice's too. Triton's
    # interpreter has no libdevice: there numpy's float32 exp / log (the CPU tests allow last-bit differences).
    if os.environ.get("TRITON_INTERPRET") == "1":
        @triton.jit
        def _exp(x):
            return tl.exp(x)

        @triton.jit
        def _log(x):
            return tl.log(x)
    else:
        @triton.jit
        def _exp(x):
            return libdevice.exp(x)

        @triton.jit
        def _log(x):
            return libdevice.log(x)

    @triton.jit
    def _expf(x, FAST: tl.constexpr):
        """exp as libdevice computes it, or with FAST the GPU's approximate 2^x of x log2(e) (``tl.exp``)."""
        if FAST:
            return tl.exp(x)
        else:
            return _exp(x)

    @triton.jit
    def _ce_fused(x_ptr, t_ptr, lse_ptr, loss_ptr, v, stride, t_stride, vocab_start, BLOCK: tl.constexpr,
                  FAST: tl.constexpr):
        """One row of logits per program: statistics, lse and loss, then softmax - onehot in place.

        Where the results can differ from ``_ce_stats`` + ``_ce_grad`` (compiled): the max and the target
        logit are exact; the sum of exp adds the same fp32 terms exp(logit - max) from the block holding the
        row's max on, but earlier blocks were summed against a smaller running max and rescaled by
        exp(old max - max) (one extra rounding each time the max grows), and the summation order is this
        kernel's (per lane, then across lanes), not Inductor's. So lse can differ in its last bits, and a
        gradient element then by one unit in the last place of the logits' dtype. Given the same lse,
        the loss (lse - target logit) and the gradient are the same fp32 operations rounded the same way
        (without FAST; with it each exp is a few fp32 units off, and a gradient element rarely one unit)."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        t = tl.load(t_ptr + row * t_stride).to(tl.int64) - vocab_start
        inside = (t >= 0) & (t < v)
        t = tl.minimum(tl.maximum(t, 0), v - 1)  # the clamped column, as _ce_stats / _ce_grad gather it
        picked = tl.where(inside, tl.load(base + t).to(tl.float32), 0.0)
        m = float("-inf")
        sums = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, v, BLOCK):
            offs = start + cols
            x = tl.load(base + offs, mask=offs < v, other=float("-inf"), eviction_policy="evict_last")
            x = x.to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, axis=0))
            # exp(m - new_m) is exactly 1 while the max stays (and 0 on the first block: the sums are 0)
            sums = sums * _expf(m - new_m, FAST) + _expf(x - new_m, FAST)
            m = new_m
        lse = m + _log(tl.sum(sums, axis=0))
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, lse - picked)
        blocks = tl.cdiv(v, BLOCK)
        for i in range(0, blocks):
            offs = (blocks - 1 - i) * BLOCK + cols  # last block first: the most recently read
            mask = offs < v
            x = tl.load(base + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            p = _expf(x - lse, FAST) - tl.where(inside & (offs == t), 1.0, 0.0)
            tl.store(base + offs, p.to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _scale_rows(t_ptr, g_ptr, out_ptr, h, t_stride, g_stride, out_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < h
        g = tl.load(g_ptr + row * g_stride)
        x = tl.load(t_ptr + row * t_stride + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + row * out_stride + offs, (x * g).to(out_ptr.dtype.element_ty), mask=mask)

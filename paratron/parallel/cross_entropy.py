"""Cross-entropy over vocabulary-parallel logits, and the output layer fused with it.

``vocab_parallel_cross_entropy`` takes logits split along the vocabulary over the TP group;
``linear_cross_entropy`` takes the output layer's input and weight and never holds fp32 logits of the
whole batch (``_LinearCrossEntropy``).

On CUDA ``_LinearCrossEntropy`` keeps one [tokens, vocab] buffer of logits in the input dtype and
overwrites it with softmax - onehot(target), so that backward is two matmuls. With a TP group of one
rank and the whole batch in one chunk (the usual case on a GPU), the per-token statistics and that
overwrite are ONE Triton kernel (``_ce_fused``): a program per row walks the row in blocks keeping a
running max and per-lane sums of exp (rescaled when the max grows, online-softmax style) and reads the
target logit, writes lse and the loss (fp32), then walks the row again, last block first (those were
read most recently, so mostly still in L2), writing exp(logit - lse) - onehot(target) rounded to the
logits' dtype in place. Its exp is the GPU's approximate one (``ex2.approx`` of x log2 e, a few fp32 units
off libdevice's expf; PARATRON_CE_FAST_EXP=0: libdevice's): with libdevice's the pass is bound by arithmetic
(3.08 against 1.74 ms alone on an H100, benchmarks/results/ce_kernel_bench_0dc6af3.md). It replaces two
compiled passes measured on an H100 at 32768 tokens x 32768 vocabulary (bf16;
benchmarks/results/profile_kernels_llama-1b_mb16x2_7056be8.tsv): the statistics pass (1.1 ms, one read of
the logits at only 1.9 TB/s), the gradient pass (1.6 ms, a read and a write), and the small [tokens] kernels
of the per-chunk statistics (sub, log, add, copy_). Over a TP group
(statistics reduced across ranks between the two passes) the two compiled passes remain.

In backward each token's incoming gradient g (fp32) scales the rows of D @ W and of x before the
weight-gradient matmul; ``bf16 * fp32`` in torch made an fp32 [tokens, hidden] tensor and then cast
it (a 357 us fp32 multiply and a 90 us cast in the same profile, twice per micro-batch).
``_row_scaled`` does ``(t.float() * g).to(t.dtype)`` in one Triton pass instead, with the same
roundings (the bf16 matmul result, one fp32 multiply, one rounding), so its results are bit-identical.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import torch.nn.functional as F

from . import comm, cublaslt
from .grad_accumulation import main_grad_of, wgrad_accumulate

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs
    triton = None

# Launch parameters of the kernels below: the cross-entropy reads a row in blocks of 8192 logits at 8 warps (4
# blocks per row at a 32k vocabulary; with the approximate exp 1.62 ms against 1.74-2.16 for the other blocks and
# warps at llama-1b's [32768, 32768] on an H100, benchmarks/results/ce_kernel_bench_56356ff.md); the row-scaling
# pass moves 2048 elements (one llama-1b hidden row) per program (0.092 ms, within 2 % of the others measured).
CE_BLOCK, CE_WARPS = 8192, 8
# exp in the kernel: the GPU's approximate 2^x of x log2(e) (``tl.exp``), or libdevice's expf as the compiled
# passes compute it (PARATRON_CE_FAST_EXP=0). With libdevice's the pass is bound by its arithmetic, not by memory:
# 3.08 against 1.74 ms at llama-1b's [32768, 32768] bf16 on an H100 (benchmarks/results/ce_kernel_bench_0dc6af3.md)
CE_FAST_EXP = os.environ.get("PARATRON_CE_FAST_EXP", "1") != "0"
SCALE_BLOCK, SCALE_WARPS = 2048, 4
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        gmax = logits.max(dim=-1).values
        if comm.group_size(group) > 1:
            torch.distributed.all_reduce(gmax, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - gmax.unsqueeze(-1)
        per_rank = logits.size(-1)
        local_t = target - vocab_start
        outside = (local_t < 0) | (local_t >= per_rank)
        local_t = local_t.masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(picked, group)
        comm.all_reduce(sum_exp, group)
        loss = sum_exp.log() - picked
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax
        onehot_val = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -onehot_val.unsqueeze(-1))
        grad.mul_(g.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token cross-entropy of logits split along the vocabulary over ``tp_group``; the full
    logits are never gathered. At TP=1 this is ``F.cross_entropy(..., reduction='none')``."""
    if comm.group_size(tp_group) == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none").view_as(target)
    vocab_start = comm.group_rank(tp_group) * logits.size(-1)
    return _VocabParallelCE.apply(logits, target, vocab_start, tp_group)


def _ce_stats(logits: torch.Tensor, local: torch.Tensor, v: int):
    """Per-token max, sum of exp(logit - max) and target logit (0 when the target is not local)."""
    lg = logits.to(torch.promote_types(logits.dtype, torch.float32))
    m = lg.max(dim=-1).values
    sum_exp = (lg - m.unsqueeze(-1)).exp().sum(dim=-1)
    inside = (local >= 0) & (local < v)
    picked = lg.gather(-1, local.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1) * inside
    return m, sum_exp, picked


def _ce_grad(logits: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, v: int):
    """softmax - onehot(target) in the logits' dtype: d loss / d logits before the incoming per-token
    gradient is applied."""
    p = (logits.to(lse.dtype) - lse.unsqueeze(-1)).exp_()
    inside = ((local >= 0) & (local < v)).to(p.dtype).unsqueeze(-1)
    if logits.is_cuda:  # compiled (``_kernel``): Inductor fuses the one-hot into the same pass over the logits
        onehot = torch.nn.functional.one_hot(local.clamp(0, v - 1), v).to(p.dtype)
        return (p - onehot * inside).to(logits.dtype)
    # eager (CPUs): the same values without a [tokens, vocab] fp32 one-hot: -1 added at each local target
    return p.scatter_add_(-1, local.clamp(0, v - 1).unsqueeze(-1), -inside).to(logits.dtype)


def _ce_grad_(logits: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, v: int) -> None:
    """``_ce_grad`` written over the logits (one read and one write of the chunk)."""
    logits.copy_(_ce_grad(logits, lse, local, v))


_compiled: dict = {}


def _kernel(fn, x: torch.Tensor):
    """On CUDA the per-chunk math runs as one compiled kernel (one pass over the chunk's logits)."""
    if not x.is_cuda:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False, options={"coordinate_descent_tuning": True})
    return _compiled[fn]


def _on_device(t: torch.Tensor):
    """The context a Triton launch on ``t`` needs: its CUDA device current (nothing for CPU tensors, which
    only Triton's interpreter runs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def fused_ce_(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0, block: int = CE_BLOCK,
              num_warps: int = CE_WARPS, fast: Optional[bool] = None):
    """``_ce_stats`` and ``_ce_grad_`` of ``logits`` [n, v] (row-contiguous) in one Triton kernel (``_ce_fused``):
    returns (lse, loss) [n] fp32 and overwrites ``logits`` with softmax - onehot(target - vocab_start).
    ``fast``: the GPU's approximate exp instead of libdevice's (None: CE_FAST_EXP)."""
    fast = CE_FAST_EXP if fast is None else fast
    n, v = logits.shape
    assert logits.stride(1) == 1 and target.shape == (n,), (logits.stride(), target.shape)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    loss = torch.empty_like(lse)
    if n:
        with _on_device(logits):
            _ce_fused[(n,)](logits, target, lse, loss, v, logits.stride(0), target.stride(0), vocab_start,
                            BLOCK=block, FAST=fast, num_warps=num_warps)
    return lse, loss


def _row_scaled(t: torch.Tensor, g: torch.Tensor, inplace: bool = False) -> torch.Tensor:
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


_FUSED = os.environ.get("PARATRON_FUSED_CE", "1") != "0"  # "0": the compiled two passes (side-by-side timing)


def _fusable(x: torch.Tensor, group, n: int, chunk: int, keep: bool) -> bool:
    """Whether the forward takes ``fused_ce_``: a kept buffer on CUDA, one chunk, one TP rank, and
    ``PARATRON_FUSED_CE`` not 0."""
    return (_FUSED and triton is not None and keep and x.is_cuda and x.dtype in _FUSED_DTYPES and 0 < n <= chunk
            and comm.group_size(group) == 1)


class _LinearCrossEntropy(torch.autograd.Function):
    """Output layer and cross-entropy in chunks of tokens, so the fp32 logits of the batch never exist.

    Forward writes each chunk's logits (in the input dtype) into one [tokens, vocab] buffer, reduces
    them to per-token statistics and overwrites them with softmax - onehot(target). As the incoming
    gradient g is one scalar per token, backward is then just two matmuls:
    d/dx = g * (D @ W) and d/dW = D^T @ (g * x). With ``keep=False`` (a buffer that would be too large)
    nothing is kept and backward recomputes each chunk's logits (one more matmul over the vocabulary).
    Over a TP group the vocabulary is split and only per-token scalars (max, sum of exp, target
    logit) are reduced, as in the vocab-parallel cross-entropy. On CUDA at one TP rank with the batch in
    one chunk the statistics and the overwrite are one Triton kernel (``fused_ce_``)."""

    @staticmethod
    def forward(ctx, x, weight, target, vocab_start, group, chunk, keep, main_grad):
        n, v = x.size(0), weight.size(0)
        ctx.vocab_start, ctx.chunk = vocab_start, chunk
        ctx.main_grad = main_grad  # (not saved: it changes as it accumulates, by design)
        if _fusable(x, group, n, chunk, keep):
            d = cublaslt.mm(x, weight)  # cuBLAS or cuBLASLt, the faster at this shape (cublaslt.py)
            lse, loss = fused_ce_(d, target, vocab_start)
            ctx.save_for_backward(x, weight, target, lse, d)
            return loss
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16/fp16 inputs
        lse = torch.empty(n, dtype=acc, device=x.device)
        picked = torch.empty(n, dtype=acc, device=x.device)
        d = torch.empty(n, v, dtype=x.dtype, device=x.device) if keep else None
        stats, grad_ = _kernel(_ce_stats, x), _kernel(_ce_grad_, x)
        for i in range(0, n, chunk):
            local = target[i:i + chunk] - vocab_start
            logits = torch.mm(x[i:i + chunk], weight.t(), out=d[i:i + chunk]) if keep else x[i:i + chunk] @ weight.t()
            m, sum_exp, t = stats(logits, local, v)
            m, sum_exp, t = m.to(acc), sum_exp.to(acc), t.to(acc)
            if comm.group_size(group) > 1:  # combine the per-rank statistics of the vocabulary shards
                gm = m.clone()
                torch.distributed.all_reduce(gm, op=torch.distributed.ReduceOp.MAX, group=group)
                sum_exp = sum_exp * (m - gm).exp()
                m = gm
                comm.all_reduce(sum_exp, group)
                comm.all_reduce(t, group)
            lse[i:i + chunk] = m + sum_exp.log()
            picked[i:i + chunk] = t
            if keep:
                grad_(logits, lse[i:i + chunk], local, v)
        ctx.save_for_backward(x, weight, target, lse, d)
        return lse - picked

    @staticmethod
    def backward(ctx, g):
        x, weight, target, lse, d = ctx.saved_tensors
        g = g.unsqueeze(-1)
        if d is not None:
            gx = _row_scaled(d @ weight, g, inplace=True)
            gw = _weight_grad(_row_scaled(x, g), d, ctx.main_grad, weight)
            return gx, gw, None, None, None, None, None, None
        n, v, chunk = x.size(0), weight.size(0), ctx.chunk
        gx = torch.empty_like(x)
        gw = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        grad = _kernel(_ce_grad, x)
        for i in range(0, n, chunk):
            xc, gc = x[i:i + chunk], g[i:i + chunk]
            dc = grad(xc @ weight.t(), lse[i:i + chunk], target[i:i + chunk] - ctx.vocab_start, v)
            gx[i:i + chunk] = dc @ weight * gc
            gw += dc.t() @ _row_scaled(xc, gc)
        if ctx.main_grad is not None:
            ctx.main_grad.add_(gw)
            return gx, torch.empty_like(weight), None, None, None, None, None, None
        return gx, gw.to(weight.dtype), None, None, None, None, None, None


def _weight_grad(xg: torch.Tensor, d: torch.Tensor, main_grad, weight: torch.Tensor):
    """The output layer's weight gradient d^T xg, computed as (xg^T d)^T: cuBLAS runs this form faster at
    vocabulary sizes (benchmarks/matmul_shapes.py: 684 vs 634 TFLOP/s at llama-1b's output layer on an H100).
    With ``main_grad`` (gradient-accumulation fusion) it is added there instead, by the same product into the
    buffer's transposed view (grad_accumulation.wgrad_accumulate), and autograd gets a placeholder."""
    if main_grad is None:
        return (xg.t() @ d).t()
    wgrad_accumulate(main_grad.t(), xg, d, False)
    return torch.empty_like(weight)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, tp_group=None,
                         chunk_bytes: int = 2**28, keep_bytes: int = 2**33) -> torch.Tensor:
    """Per-token cross-entropy of ``x @ weight.T`` (``weight``: this rank's vocabulary rows) without
    materialising fp32 logits of all tokens; ``x`` [..., h], ``target`` [...]. Equal to
    ``vocab_parallel_cross_entropy(F.linear(x, weight), target)`` up to rounding. ``chunk_bytes``
    bounds the fp32 temporaries of one chunk (eager); the gradient buffer (tokens x vocabulary in
    the input dtype) is kept for backward when it fits in ``keep_bytes``, else recomputed."""
    shape = target.shape
    xf, tf = x.reshape(-1, x.size(-1)), target.reshape(-1)
    vocab_start = comm.group_rank(tp_group) * weight.size(0)
    keep = xf.size(0) * weight.size(0) * xf.element_size() <= keep_bytes
    # Chunks bound the fp32 temporaries of the eager statistics; the compiled kernels used on CUDA
    # have none, so a kept buffer is then filled by one matmul (faster than many narrow ones).
    chunk = xf.size(0) if keep and xf.is_cuda else max(1, chunk_bytes // (4 * weight.size(0)))
    return _LinearCrossEntropy.apply(xf, weight, tf, vocab_start, tp_group, chunk, keep,
                                     main_grad_of(weight)).view(shape)

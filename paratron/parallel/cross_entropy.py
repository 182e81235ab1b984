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
off libdevice's expf; ``--kernel-ce-fast-exp off``: libdevice's): with libdevice's the pass is bound by
arithmetic, much slower than with the approximate exp (the kernel alone on an H100:
benchmarks/results/ce_kernel_bench_0dc6af3.md). It replaces two
compiled passes measured on an H100 at 32768 tokens x 32768 vocabulary (bf16;
benchmarks/results/profile_kernels_llama-1b_mb16x2_7056be8.tsv): the statistics pass (one read of the logits,
well below the memory bandwidth), the gradient pass (a read and a write), and the small [tokens] kernels
of the per-chunk statistics (sub, log, add, copy_). Over a TP group
(statistics reduced across ranks between the two passes) the two compiled passes remain.

In backward each token's incoming gradient g (fp32) scales the rows of D @ W and of x before the
weight-gradient matmul; ``bf16 * fp32`` in torch made an fp32 [tokens, hidden] tensor and then cast
it (an fp32 multiply and a cast in the same profile, twice per micro-batch).
``row_scaled`` does ``(t.float() * g).to(t.dtype)`` in one Triton pass instead, with the same
roundings (the bf16 matmul result, one fp32 multiply, one rounding), so its results are bit-identical.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import comm
from ..kernels import cublaslt
from ..kernels.accumulate import wgrad_accumulate
from .linear import main_grad_of
from ..kernels.cross_entropy import FUSED_DTYPES, fused_ce_, row_scaled, triton


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


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    """``fn`` compiled once (static shapes, Inductor's coordinate-descent tuning)."""
    return torch.compile(fn, dynamic=False, options={"coordinate_descent_tuning": True})


def _kernel(fn, x: torch.Tensor):
    """On CUDA the per-chunk math runs as one compiled kernel (one pass over the chunk's logits)."""
    return _compiled(fn) if x.is_cuda else fn


def logits_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None, kernel: str = "triton",
                         fast_exp: bool = True) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(logits, target, tp_group)`` for a model whose output layer has a bias (BERT's),
    where the fused output layer + loss does not apply. At one TP rank on CUDA with bf16 (or fp32) logits and
    ``kernel`` "auto" or "triton" (``--kernel-cross-entropy``) the loss is the one-pass Triton kernel over the logits
    (``fused_ce_``), which overwrites them with softmax - onehot(target), so that no fp32 copy of the logits of every
    token exists: the logits must not be read after this call, and the backward runs once. fp16 logits keep the
    plain loss: softmax - onehot rounded to fp16 before the loss scale multiplies it would lose the small
    probabilities of a wide vocabulary to fp16's subnormals. ``fast_exp``: ``--kernel-ce-fast-exp``."""
    if _logits_fusable(logits, tp_group, kernel):
        return _LogitsCrossEntropy.apply(logits, target, fast_exp)
    return vocab_parallel_cross_entropy(logits, target, tp_group)


def _logits_fusable(logits: torch.Tensor, group, kernel: str) -> bool:
    return (kernel != "compiled" and triton is not None and logits.is_cuda and logits.dtype in FUSED_DTYPES
            and logits.dtype != torch.float16 and logits.is_contiguous() and comm.group_size(group) == 1)


class _LogitsCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``logits`` [..., v] by ``fused_ce_``, which overwrites the logits' buffer with softmax -
    onehot(target) in their dtype; backward scales it row by row by the incoming per-token gradient (``row_scaled``,
    in place): the gradient the logits' producer receives. The buffer is taken over rather than marked dirty (an
    output layer's logits are a view of its matmul's result, which autograd does not let a function return dirty
    beside its loss): the caller must not read the logits after this call, and the producer must not need them for
    its backward (a linear layer's backward reads its input and weight)."""

    @staticmethod
    def forward(ctx, logits, target, fast_exp):
        _, loss = fused_ce_(logits.view(-1, logits.size(-1)), target.reshape(-1), 0, fast=fast_exp)
        ctx.save_for_backward(logits)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, g):
        d, = ctx.saved_tensors
        flat = d.view(-1, d.size(-1))
        return row_scaled(flat, g.reshape(-1, 1).float(), inplace=True).view(d.shape), None, None


def _fusable(x: torch.Tensor, group, n: int, chunk: int, keep: bool, kernel: str) -> bool:
    """Whether the forward takes ``fused_ce_``: the Triton kernel not switched off (``--kernel-cross-entropy``), a kept
    buffer on CUDA, one chunk, one TP rank."""
    return (kernel != "compiled" and triton is not None and keep and x.is_cuda and x.dtype in FUSED_DTYPES
            and 0 < n <= chunk and comm.group_size(group) == 1)


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
    def forward(ctx, x, weight, target, vocab_start, group, chunk, keep, main_grad, kernel, fast_exp, lt):
        n, v = x.size(0), weight.size(0)
        ctx.vocab_start, ctx.chunk = vocab_start, chunk
        ctx.main_grad = main_grad  # (not saved: it changes as it accumulates, by design)
        if _fusable(x, group, n, chunk, keep, kernel):
            d = cublaslt.mm(x, weight, lt)  # cuBLAS or cuBLASLt, the faster at this shape (kernels/cublaslt.py)
            lse, loss = fused_ce_(d, target, vocab_start, fast=fast_exp)
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
            gx = row_scaled(d @ weight, g, inplace=True)
            gw = _weight_grad(row_scaled(x, g), d, ctx.main_grad, weight)
            return gx, gw, None, None, None, None, None, None, None, None, None
        n, v, chunk = x.size(0), weight.size(0), ctx.chunk
        gx = torch.empty_like(x)
        gw = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        grad = _kernel(_ce_grad, x)
        for i in range(0, n, chunk):
            xc, gc = x[i:i + chunk], g[i:i + chunk]
            dc = grad(xc @ weight.t(), lse[i:i + chunk], target[i:i + chunk] - ctx.vocab_start, v)
            gx[i:i + chunk] = dc @ weight * gc
            gw += dc.t() @ row_scaled(xc, gc)
        if ctx.main_grad is not None:
            ctx.main_grad.add_(gw)
            return gx, torch.empty_like(weight), None, None, None, None, None, None, None, None, None
        return gx, gw.to(weight.dtype), None, None, None, None, None, None, None, None, None


def _weight_grad(xg: torch.Tensor, d: torch.Tensor, main_grad, weight: torch.Tensor):
    """The output layer's weight gradient d^T xg, computed as (xg^T d)^T: cuBLAS runs this form faster at
    vocabulary sizes (llama-1b's output layer on an H100, timed by benchmarks/matmul_shapes.py:
    benchmarks/results/matmul_shapes_20261126_0906.txt).
    With ``main_grad`` (gradient-accumulation fusion) it is added there instead, by the same product into the
    buffer's transposed view (linear.wgrad_accumulate), and autograd gets a placeholder."""
    if main_grad is None:
        return (xg.t() @ d).t()
    wgrad_accumulate(main_grad.t(), xg, d, False)
    return torch.empty_like(weight)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, tp_group=None,
                         chunk_bytes: int = 2**28, keep_bytes: int = 2**33, kernel: str = "triton",
                         fast_exp: bool = True, cublaslt: bool = True) -> torch.Tensor:
    """Per-token cross-entropy of ``x @ weight.T`` (``weight``: this rank's vocabulary rows) without
    materialising fp32 logits of all tokens; ``x`` [..., h], ``target`` [...]. Equal to
    ``vocab_parallel_cross_entropy(F.linear(x, weight), target)`` up to rounding. ``chunk_bytes``
    bounds the fp32 temporaries of one chunk (eager); the gradient buffer (tokens x vocabulary in
    the input dtype) is kept for backward when it fits in ``keep_bytes``, else recomputed. ``kernel`` /
    ``fast_exp``, ``cublaslt``: the kernel switches ``--kernel-cross-entropy`` (auto, triton: the one Triton pass
    where it applies; compiled: the two compiled passes), ``--kernel-ce-fast-exp`` and ``--kernel-cublaslt``."""
    shape = target.shape
    xf, tf = x.reshape(-1, x.size(-1)), target.reshape(-1)
    vocab_start = comm.group_rank(tp_group) * weight.size(0)
    keep = xf.size(0) * weight.size(0) * xf.element_size() <= keep_bytes
    # Chunks bound the fp32 temporaries of the eager statistics; the compiled kernels used on CUDA
    # have none, so a kept buffer is then filled by one matmul rather than many narrow ones.
    chunk = xf.size(0) if keep and xf.is_cuda else max(1, chunk_bytes // (4 * weight.size(0)))
    return _LinearCrossEntropy.apply(xf, weight, tf, vocab_start, tp_group, chunk, keep, main_grad_of(weight),
                                     kernel, fast_exp, cublaslt).view(shape)

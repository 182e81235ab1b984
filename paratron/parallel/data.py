"""Data parallelism: gradients accumulate into one contiguous buffer split into buckets, each bucket
reduced over the data(-and-context)-parallel group; plus the cross-group gradient fix-ups every
layout needs before the optimizer step (Megatron's ``finalize_model_grads``).

Layout. Parameters are laid out in the buffer in reverse order (the order backward produces their
gradients), each start aligned to 64 elements, and cut into buckets of at least ``bucket_size``
elements; each bucket is padded to a multiple of 64 x dp_cp so that it splits into equal,
aligned shards, one per data-parallel rank. Each parameter gets ``param.main_grad``, a view into
the buffer (fp32 by default, so bf16 parameters accumulate micro-batch gradients in fp32); a hook
run after autograd accumulates a gradient adds it to ``main_grad`` and frees ``param.grad``.

Reduction. Each bucket is divided by dp_cp (not with --calculate-per-token-loss: ``average=False``,
finalize_model_grads then divides by the step's token count), then all-reduced, or reduce-scattered
in place when the distributed optimizer is used (each rank then holds the summed gradient of its own
shard only).
Without ``overlap_grad_reduce`` every bucket is reduced in ``finish_grad_sync()`` after the last
micro-batch. With it, a bucket's collective is launched from the hook as soon as its last gradient
of the last micro-batch is ready, and ``finish_grad_sync()`` only waits. The schedule says which
micro-batch is the last: it runs all the others under ``model.no_sync()`` (Megatron's convention).

Distributed optimizer (ZeRO-1). The parameters themselves then also live in one contiguous buffer
with the same layout (``param.data`` is a view into it). After the optimizer has updated its shard,
``start_param_sync()`` all-gathers each bucket; with ``overlap_param_gather`` the all-gathers run
in the background and a forward pre-hook on each module waits only for the buckets of that
module's parameters, so the next forward overlaps with the gathering.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .dims import ParallelDims

ALIGN = 64  # elements; keeps parameter views and shard boundaries aligned for fast kernels
# Megatron's default bucket size with --overlap-grad-reduce: max(40M, 1M x dp) elements.
DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK = 40_000_000, 1_000_000

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Bucket:
    """A contiguous range [start, end) of the buffers holding whole parameters."""

    def __init__(self, index: int, params: list, start: int, end: int):
        self.index, self.params, self.start, self.end = index, params, start, end
        self.grad_work = None  # async reduce in flight (or finished, until finish_grad_sync)
        self.gather_work = None  # async parameter all-gather in flight
        self.pending: set = set()  # parameters whose last-micro-batch gradient has not arrived

    @property
    def numel(self) -> int:
        return self.end - self.start


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, dims: ParallelDims, *, grad_dtype: torch.dtype = torch.float32,
                 bucket_size: Optional[int] = None, overlap_grad_reduce: bool = False,
                 use_distributed_optimizer: bool = False, overlap_param_gather: bool = False,
                 average: bool = True):
        """``average``: divide the gradients by dp x cp before summing them (False with
        --calculate-per-token-loss: finalize_model_grads divides by the step's token count instead)."""
        super().__init__()
        self.module, self.dims = module, dims
        self.group = dims.dp_cp_group
        self.n, self.rank = comm.group_size(self.group), comm.group_rank(self.group)
        self.overlap_grad_reduce, self.average = overlap_grad_reduce, average
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather and use_distributed_optimizer
        self.is_last_microbatch = True  # the schedule sets it False (no_sync) on the other micro-batches
        self.buckets_launched_in_backward = 0  # counted per step, for tests and logs
        self.params = [p for p in module.parameters() if p.requires_grad]
        if bucket_size is None and overlap_grad_reduce:
            bucket_size = max(DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK * self.n)
        self.buckets, offsets, total = self._layout(bucket_size)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        self._unwritten: set = set()
        self.param_buffer = None
        if use_distributed_optimizer and self.params:
            dtypes = {p.dtype for p in self.params}
            if len(dtypes) > 1:
                raise ValueError(f"the distributed optimizer needs one parameter dtype, got {sorted(map(str, dtypes))}")
            self.param_buffer = torch.zeros(total, dtype=self.params[0].dtype, device=device)
        with torch.no_grad():
            for p in self.params:
                off = offsets[p]
                p.main_grad = self.grad_buffer[off: off + p.numel()].view_as(p)
                if self.param_buffer is not None:
                    view = self.param_buffer[off: off + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view
        self.param_offsets = offsets
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        if self.overlap_param_gather and self.n > 1:
            for m, buckets in self._gather_points(module).items():
                wait = torch._dynamo.disable(lambda _m, _a, bs=buckets: self._wait_gather(bs))
                self._hooks.append(m.register_forward_pre_hook(wait))
        self.zero_grad_buffer()

    def _gather_points(self, module: nn.Module) -> dict:
        """{module: buckets its forward must wait for}: each module owning parameters, except that a
        compiled module (``module.compile()``, e.g. a layer with --torch-compile) waits once for its
        whole subtree, so no hook runs inside the compiled region."""
        points = {}

        def visit(m: nn.Module, owner) -> None:
            if owner is None and getattr(m, "_compiled_call_impl", None) is not None:
                owner = m
            own = [p for p in m.parameters(recurse=False) if p in self._bucket_of]
            if own:
                points.setdefault(owner or m, set()).update(self._bucket_of[p] for p in own)
            for child in m.children():
                visit(child, owner)

        visit(module, None)
        return {m: sorted(bs, key=lambda b: -b.index) for m, bs in points.items()}

    def _layout(self, bucket_size: Optional[int]):
        """Buckets over the parameters in reverse order; returns (buckets, offsets, total size)."""
        buckets, offsets, current = [], {}, []
        start = pos = 0

        def close():
            nonlocal start, pos, current
            end = _round_up(pos, ALIGN * self.n)
            buckets.append(Bucket(len(buckets), current, start, end))
            start = pos = end
            current = []

        for p in reversed(self.params):
            # With reduce-scatter, the tied embedding's two copies (first and last pipeline stage) must
            # be sharded identically over dp for the embedding-group all-reduce after it: own bucket.
            own = self.use_distributed_optimizer and (getattr(p, "shared_embedding", False)
                                                      or getattr(p, "is_word_embedding", False))
            if own and current:
                close()
            pos = _round_up(pos, ALIGN)
            offsets[p] = pos
            pos += p.numel()
            current.append(p)
            if own or (bucket_size is not None and pos - start >= bucket_size):
                close()
        if current:
            close()
        return buckets, offsets, start

    # ---- gradients ------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if p in self._unwritten:  # first gradient of the step: write it (the buffer is not zero-filled)
            p.main_grad.copy_(p.grad)
            self._unwritten.discard(p)
        else:
            p.main_grad.add_(p.grad)
        p.grad = None
        if not (self.overlap_grad_reduce and self.is_last_microbatch and self.n > 1):
            return
        b = self._bucket_of[p]
        if b.grad_work is not None:
            raise RuntimeError(
                f"a gradient arrived for bucket {b.index} after its reduction started: with --overlap-grad-reduce "
                "the schedule must run every micro-batch but the last under model.no_sync()")
        b.pending.discard(p)
        if not b.pending:
            self._start_grad_reduce(b)
            self.buckets_launched_in_backward += 1

    def shard_range(self, b: Bucket) -> tuple[int, int]:
        """This rank's [lo, hi) of bucket ``b`` in buffer coordinates."""
        size = b.numel // self.n
        lo = b.start + self.rank * size
        return lo, lo + size

    def _start_grad_reduce(self, b: Bucket) -> None:
        g = self.grad_buffer[b.start: b.end]
        if self.average:
            g.div_(self.n)  # average over dp x cp (Megatron scales before the collective)
        if self.use_distributed_optimizer:
            lo, hi = self.shard_range(b)
            b.grad_work = _reduce_scatter(self.grad_buffer[lo: hi], g, group=self.group, async_op=True)
        else:
            b.grad_work = dist.all_reduce(g, group=self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """After the last backward of the step: reduce the buckets not reduced yet, wait for all."""
        for p in self._unwritten:  # parameters that got no gradient this step
            p.main_grad.zero_()
        self._unwritten.clear()
        if self.n > 1:
            for b in self.buckets:
                if b.grad_work is None:
                    self._start_grad_reduce(b)
            for b in self.buckets:
                b.grad_work.wait()
                b.grad_work = None

    def zero_grad_buffer(self) -> None:
        """Start a step. Instead of zero-filling the buffer, each parameter's first gradient is
        copied in (saves a write and a read of the whole buffer); finish_grad_sync zeroes the rest.
        Padding between parameters is zero from construction and never written."""
        self._unwritten = set(self.params)
        self.buckets_launched_in_backward = 0
        for b in self.buckets:
            b.grad_work = None
            b.pending = set(b.params)

    @contextmanager
    def no_sync(self):
        """Run the micro-batches that are not the last of the step under this: no communication."""
        previous, self.is_last_microbatch = self.is_last_microbatch, False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    # ---- parameters (distributed optimizer) -----------------------------------------------------
    def start_param_sync(self) -> None:
        """All-gather every bucket's updated shards; in the background with overlap_param_gather."""
        if self.param_buffer is None or self.n == 1:
            return
        for b in reversed(self.buckets):  # the first layers' bucket first: the forward needs it first
            lo, hi = self.shard_range(b)
            b.gather_work = _all_gather(self.param_buffer[b.start: b.end], self.param_buffer[lo: hi],
                                        group=self.group, async_op=True)
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def _wait_gather(self, buckets) -> None:
        for b in buckets:
            if b.gather_work is not None:
                b.gather_work.wait()
                b.gather_work = None

    def finish_param_sync(self) -> None:
        """Wait for any parameter all-gather still in flight (before reading the parameters)."""
        self._wait_gather(self.buckets)

    # ---- module interface -----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.load_state_dict(*args, **kwargs)


def grad_buffer_dtype(cfg) -> torch.dtype:
    """Megatron's rule: fp32 gradients for bf16 unless --grad-reduce-in-bf16; for fp16 only with
    --accumulate-allreduce-grads-in-fp32; fp32 for fp32 parameters."""
    tr, par = cfg.train, cfg.parallel
    if tr.bf16:
        return torch.bfloat16 if par.grad_reduce_in_bf16 else torch.float32
    if tr.fp16:
        return torch.float32 if par.accumulate_allreduce_grads_in_fp32 else torch.float16
    return torch.float32


def wrap_data_parallel(module: nn.Module, cfg, dims: ParallelDims) -> DataParallel:
    """DataParallel configured from the run's flags."""
    par = cfg.parallel
    return DataParallel(module, dims, grad_dtype=grad_buffer_dtype(cfg), bucket_size=par.ddp_bucket_size,
                        overlap_grad_reduce=par.overlap_grad_reduce,
                        use_distributed_optimizer=par.use_distributed_optimizer,
                        overlap_param_gather=par.overlap_param_gather,
                        average=not cfg.train.calculate_per_token_loss)


def finalize_model_grads(models: list[DataParallel], dims: ParallelDims,
                         num_tokens: Optional[torch.Tensor] = None) -> None:
    """After the last backward of a step: data-parallel reduction, then the sums over TP of the
    gradients of sequence-parallel replicated parameters, then the sum over the embedding group of
    the tied embedding's two copies (first and last pipeline stage). After a reduce-scatter only this
    rank's shard of each gradient is right; the later sums keep it right because TP ranks share one
    buffer layout and the tied embedding has a bucket of its own.
    ``num_tokens`` (--calculate-per-token-loss): this rank's loss-token count of the step, known on
    the last pipeline stage only; it is broadcast over the pipeline group, summed over dp x cp, and
    every gradient is divided by that global count (as Megatron's)."""
    for m in models:
        m.finish_grad_sync()
    if dims.tp > 1:
        sp = [p.main_grad for m in models for p in m.params if getattr(p, "sequence_parallel", False)]
        if sp:
            flat = torch.cat([g.reshape(-1) for g in sp])
            dist.all_reduce(flat, group=dims.tp_group)
            offset = 0
            for g in sp:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
    if dims.pp > 1 and dims.embedding_group is not None:
        tied = [p for m in models for p in m.params
                if getattr(p, "shared_embedding", False) or getattr(p, "is_word_embedding", False)]
        if models and not getattr(models[0], "tied_embedding_checked", False):
            _check_tied_embedding(len(tied), dims, tied[0].device if tied else models[0].grad_buffer.device)
            models[0].tied_embedding_checked = True
        for p in tied:
            dist.all_reduce(p.main_grad, group=dims.embedding_group)
    if num_tokens is not None:
        n = num_tokens.detach().to(torch.float64).clone()  # the sum over ranks stays exact beyond 2^24
        if dims.pp > 1:
            dist.broadcast(n, src=dims.pp_peer(dims.pp - 1 - dims.pp_rank), group=dims.pp_group)
        if dims.dp_cp > 1:
            dist.all_reduce(n, group=dims.dp_cp_group)
        for m in models:
            m.grad_buffer.mul_(1.0 / n.clamp(min=1))


def _check_tied_embedding(count: int, dims: ParallelDims, device) -> None:
    """Once per run: the first and last pipeline stage must mark the same number of tied-embedding
    copies (``is_word_embedding`` / ``shared_embedding``), or the all-reduce above would hang."""
    lo = torch.tensor([count], device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=dims.embedding_group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=dims.embedding_group)
    if lo.item() != hi.item():
        raise RuntimeError(
            f"the first and last pipeline stages mark {lo.item()} and {hi.item()} tied-embedding parameters: the "
            "first stage's word embedding needs is_word_embedding = True and the last stage's copy "
            "shared_embedding = True (their gradients are summed over the embedding group)")

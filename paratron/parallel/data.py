"""Data parallelism: gradients accumulate into contiguous buffers split into buckets, each buffer
reduced over its own group; plus the cross-group gradient fix-ups every layout needs before the
optimizer step (Megatron's ``finalize_model_grads``).

Buffers. Parameters are grouped by how their gradient is reduced (``ShardSpec.grad_group``: dense
parameters over data x context parallelism, an expert's over its expert-data-parallel group) and
whether they are a tied pair's copy (the word embedding and the last pipeline stage's output
layer): one :class:`GradBuffer` per group, each with its parameters, process group, dtype, divisor,
buckets and the groups its squared gradient norm is summed over.

Layout. In a buffer, parameters are laid out in reverse order (the order backward produces their
gradients), each start aligned to 64 elements, and cut into buckets of at least ``bucket_size``
elements; each bucket is padded to a multiple of 64 x (group size) so that it splits into equal,
aligned shards, one per rank of the group. Each parameter gets ``param.main_grad``, a view into
its buffer (fp32 by default, so bf16 parameters accumulate micro-batch gradients in fp32); a hook
run after autograd accumulates a gradient adds it to ``main_grad`` and frees ``param.grad``. The linear
layers' weights (gradient-accumulation fusion, on unless --no-gradient-accumulation-fusion) get their
gradient added to ``main_grad`` by their backward's GEMM itself (parallel/linear.py): the hook
only frees the placeholder autograd hands it.

Reduction. Each bucket is divided by the data x context parallel size (not with
``--calculate-per-token-loss``), then all-reduced, or reduce-scattered in place when the
distributed optimizer is used (each rank then holds the summed gradient of its own shard only).
Without ``overlap_grad_reduce`` every bucket is reduced in ``finish_grad_sync()`` after the last
micro-batch. With it, a bucket's collective is launched from the hook as soon as its last gradient
of the last micro-batch is ready, and ``finish_grad_sync()`` only waits. The schedule says which
micro-batch is the last: it runs all the others under ``model.no_sync()`` (Megatron's convention).

Distributed optimizer (ZeRO-1). The parameters themselves then also live in each buffer's
contiguous storage with the same layout (``param.data`` is a view into it). After the optimizer has
updated its shard, ``start_param_sync()`` all-gathers each bucket; with ``overlap_param_gather`` the
all-gathers run in the background and a forward pre-hook on each module waits only for the buckets
of that module's parameters, so the next forward overlaps with the gathering.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .dims import ParallelDims
from .linear import fusable_weights
from ..kernels.accumulate import accumulate_
from .sharding import norm_groups, spec_of, update_spec

ALIGN = 64  # elements; keeps parameter views and shard boundaries aligned for fast kernels
# Megatron's default bucket size with --overlap-grad-reduce: max(40M, 1M x dp) elements.
DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK = 40_000_000, 1_000_000

_reduce_scatter = comm.reduce_scatter_single
_all_gather = comm.all_gather_single


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Bucket:
    """A contiguous range [start, end) of one GradBuffer's storage holding whole parameters."""

    def __init__(self, index: int, buffer: "GradBuffer", params: list, start: int, end: int):
        self.index, self.buffer, self.params, self.start, self.end = index, buffer, params, start, end
        self.grad_work = None  # async reduce in flight (or finished, until finish_grad_sync)
        self.gather_work = None  # async parameter all-gather in flight
        self.pending: set = set()  # parameters whose last-micro-batch gradient has not arrived

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self) -> tuple[int, int]:
        """This rank's [lo, hi) of the bucket, in its buffer's coordinates."""
        size = self.numel // self.buffer.n
        lo = self.start + self.buffer.rank * size
        return lo, lo + size


class GradBuffer:
    """The gradients of the parameters that are reduced alike (same group, same divisor, same
    tied-ness), contiguous and cut into buckets; with the distributed optimizer their parameters
    too. ``norm_groups``: the groups a squared gradient norm of these parameters is summed over."""

    def __init__(self, params: list, dims: ParallelDims, grad_group: str, tied: Optional[str], *,
                 grad_dtype: torch.dtype, bucket_size: Optional[int], distributed: bool, average: bool,
                 first_index: int = 0):
        self.params, self.grad_group, self.tied = params, grad_group, tied
        self.group = dims.group(grad_group)
        self.n, self.rank = comm.group_size(self.group), comm.group_rank(self.group)
        # Megatron averages dense and expert gradients alike over data x context parallelism (an
        # expert's gradient already sums the tokens its EP peers sent it); none with per-token loss.
        self.divisor = dims.size("dp_cp") if average else 1
        self.norm_groups = norm_groups(grad_group, distributed)
        self.buckets, self.offsets, total = self._layout(bucket_size, first_index)
        device = params[0].device
        self.grad_data = torch.zeros(total, dtype=grad_dtype, device=device)
        self.param_data = None
        if distributed:
            dtypes = {p.dtype for p in params}
            if len(dtypes) > 1:
                raise ValueError(f"the distributed optimizer needs one parameter dtype, got {sorted(map(str, dtypes))}")
            self.param_data = torch.zeros(total, dtype=params[0].dtype, device=device)
        with torch.no_grad():
            for p in params:
                off = self.offsets[p]
                p.main_grad = self.grad_data[off: off + p.numel()].view_as(p)
                if self.param_data is not None:
                    view = self.param_data[off: off + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view

    def _layout(self, bucket_size: Optional[int], first_index: int):
        """Buckets over the parameters in reverse order (the order backward produces their
        gradients), each start aligned to ALIGN elements, each bucket padded to ALIGN x n so that it
        splits into equal aligned shards; returns (buckets, offsets, total size)."""
        buckets, offsets, current = [], {}, []
        start = pos = 0
        for p in reversed(self.params):
            pos = _round_up(pos, ALIGN)
            offsets[p] = pos
            pos += p.numel()
            current.append(p)
            if bucket_size is not None and pos - start >= bucket_size:
                end = _round_up(pos, ALIGN * self.n)
                buckets.append(Bucket(first_index + len(buckets), self, current, start, end))
                start, pos, current = end, end, []
        if current:
            end = _round_up(pos, ALIGN * self.n)
            buckets.append(Bucket(first_index + len(buckets), self, current, start, end))
            start = end
        return buckets, offsets, start

    def start_grad_reduce(self, b: Bucket) -> None:
        """Scale the bucket and start its reduction (only the scaling when the group is one rank: an
        expert buffer whose expert-data-parallel group is smaller than data x context parallelism)."""
        g = self.grad_data[b.start: b.end]
        if self.divisor != 1:
            g.div_(self.divisor)  # Megatron scales before the collective
        if self.n == 1:
            return
        if self.param_data is not None:
            lo, hi = b.shard_range()
            b.grad_work = _reduce_scatter(self.grad_data[lo: hi], g, group=self.group, async_op=True)
        else:
            b.grad_work = dist.all_reduce(g, group=self.group, async_op=True)

    def start_param_gather(self, b: Bucket) -> None:
        lo, hi = b.shard_range()
        b.gather_work = _all_gather(self.param_data[b.start: b.end], self.param_data[lo: hi], group=self.group,
                                    async_op=True)


def _weak_on_grad(dp: "DataParallel"):
    """``dp._on_grad`` as a hook that does not keep ``dp`` alive."""
    ref = weakref.ref(dp)

    def hook(p: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad(p)
    return hook


def buffer_keys(params: list) -> dict:
    """{(grad group, tied group): parameters, in module order}: one gradient buffer each. A tied
    parameter gets a buffer of its own so that both pipeline copies are sharded identically over
    data parallelism (the sum over the embedding group after a reduce-scatter relies on it)."""
    keys: dict = {}
    for p in params:
        spec = spec_of(p)
        keys.setdefault((spec.grad_group, spec.tied), []).append(p)
    return dict(sorted(keys.items(), key=lambda kv: (kv[0][0] != "dp_cp", kv[0][1] is not None)))


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, dims: ParallelDims, *, grad_dtype: torch.dtype = torch.float32,
                 bucket_size: Optional[int] = None, overlap_grad_reduce: bool = False,
                 use_distributed_optimizer: bool = False, overlap_param_gather: bool = False,
                 average: bool = True, fuse_wgrad: bool = False, fused_accumulate: bool = True):
        super().__init__()
        self.module, self.dims = module, dims
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.is_last_microbatch = True  # the schedule sets it False (no_sync) on the other micro-batches
        self.buckets_launched_in_backward = 0  # counted per step, for tests and logs
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers_: list[GradBuffer] = []
        for (group, tied), params in buffer_keys(self.params).items():
            n = dims.size(group)
            size = bucket_size
            if size is None and overlap_grad_reduce:
                size = max(DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK * n)
            first = sum(len(b.buckets) for b in self.buffers_)
            self.buffers_.append(GradBuffer(params, dims, group, tied, grad_dtype=grad_dtype, bucket_size=size,
                                            distributed=use_distributed_optimizer, average=average,
                                            first_index=first))
        self.buckets = [b for buf in self.buffers_ for b in buf.buckets]
        # what finalize_model_grads does after the reduction, read off the specs once
        self.partial_grads: dict[str, list] = {}  # group: gradients to sum over it (ShardSpec.sum_over)
        for p in self.params:
            for name in spec_of(p).sum_over:
                self.partial_grads.setdefault(name, []).append(p.main_grad)
        self.tied_params = [p for p in self.params if spec_of(p).tied is not None]
        self.tied_checked = False  # the pipeline stages agreed on their tied copies (once per run)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self.overlap_param_gather = (overlap_param_gather and use_distributed_optimizer
                                     and any(buf.n > 1 for buf in self.buffers_))
        self._unwritten: set = set()
        # Megatron's gradient-accumulation fusion (linear.py): these weights' backward adds their
        # gradient to main_grad itself; the hook only drops the placeholder autograd hands it
        self.fused_wgrad = set(fusable_weights(module)) & set(self.params) if fuse_wgrad else set()
        for p in self.params:  # every parameter's spec says it, so a module wrapped again follows the new wrapper
            update_spec(p, fuse_wgrad=p in self.fused_wgrad)
        # the micro-batch gradients go into main_grad by one Triton pass (accumulate_) unless
        # --kernel-fused-accumulate off (torch's copy_ / add_)
        self._fused_accumulate = fused_accumulate
        # The hooks reach this object through a weak reference: a parameter's hooks are held from C++, where
        # the garbage collector does not see them, so a bound method there would keep the wrapper, the model
        # and its weights alive for the life of the process after the trainer is gone.
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_on_grad(self)) for p in self.params]
        if self.overlap_param_gather:
            for m, buckets in self._gather_points(module).items():
                wait = torch._dynamo.disable(lambda _m, _a, bs=buckets: self._wait_gather(bs))
                self._hooks.append(m.register_forward_pre_hook(wait))
        self.zero_grad_buffer()

    @property
    def grad_buffers(self) -> list[GradBuffer]:
        return self.buffers_

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The storage of the dense parameters' gradients (the first buffer)."""
        return self.buffers_[0].grad_data

    def buffer_of(self, p: torch.Tensor) -> GradBuffer:
        return self._bucket_of[p].buffer

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

    # ---- gradients ------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        # the first gradient of the step is written (the buffer is not zero-filled), later ones added
        if p not in self.fused_wgrad:
            accumulate_(p.main_grad, p.grad, write=p in self._unwritten, fused=self._fused_accumulate)
        self._unwritten.discard(p)
        p.grad = None
        b = self._bucket_of[p]
        if not (self.overlap_grad_reduce and self.is_last_microbatch and b.buffer.n > 1):
            return
        if b.grad_work is not None:
            raise RuntimeError(
                f"a gradient arrived for bucket {b.index} after its reduction started: with --overlap-grad-reduce "
                "the schedule must run every micro-batch but the last under model.no_sync()")
        b.pending.discard(p)
        if not b.pending:
            b.buffer.start_grad_reduce(b)
            self.buckets_launched_in_backward += 1

    def finish_grad_sync(self) -> None:
        """After the last backward of the step: reduce the buckets not reduced yet, wait for all."""
        for p in self._unwritten:  # parameters that got no gradient this step
            p.main_grad.zero_()
        self._unwritten.clear()
        for b in self.buckets:
            if b.grad_work is None:  # not launched in backward (or a one-rank group: scaled only)
                b.buffer.start_grad_reduce(b)
        for b in self.buckets:
            if b.grad_work is not None:
                b.grad_work.wait()
                b.grad_work = None

    def zero_grad_buffer(self) -> None:
        """Start a step. Instead of zero-filling the buffers, each parameter's first gradient is
        copied in (saves a write and a read of the whole buffer); finish_grad_sync zeroes the rest. The
        weights whose backward adds to main_grad (``fused_wgrad``) are zeroed here, in one launch.
        Padding between parameters is zero from construction and never written."""
        if self.fused_wgrad:
            torch._foreach_zero_([p.main_grad for p in self.fused_wgrad])
        self._unwritten = set(self.params) - self.fused_wgrad
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

    def scale_grads(self, factor) -> None:
        """Multiply every gradient by ``factor`` (a number or a 0-d tensor)."""
        for buf in self.buffers_:
            buf.grad_data.mul_(factor)

    # ---- parameters (distributed optimizer) -----------------------------------------------------
    def start_param_sync(self) -> None:
        """All-gather every bucket's updated shards; in the background with overlap_param_gather."""
        if not self.use_distributed_optimizer:
            return
        for b in reversed(self.buckets):  # the first layers' bucket first: the forward needs it first
            if b.buffer.n > 1:
                b.buffer.start_param_gather(b)
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
                        average=not cfg.train.calculate_per_token_loss,
                        fuse_wgrad=not par.no_gradient_accumulation_fusion,
                        fused_accumulate=cfg.kernels.kernel_fused_accumulate != "off")


def finalize_model_grads(models: list[DataParallel], dims: ParallelDims, num_tokens=None) -> None:
    """After the last backward of a step: each gradient buffer's reduction over its group, then the
    sums of partial gradients over model-parallel groups (``spec.sum_over``: sequence-parallel
    replicated parameters over TP), then the sum of tied copies over their group (the word
    embedding's two pipeline copies over the embedding group). After a reduce-scatter only this
    rank's shard of each gradient is right; the later sums keep it right because the ranks of those
    groups share one buffer layout, and a tied parameter has a buffer of its own.

    ``num_tokens`` (``--calculate-per-token-loss``): this rank's loss-token count of the step (known
    on the last pipeline stage); the gradients, summed rather than averaged over data parallelism,
    are divided by the global count."""
    for m in models:
        m.finish_grad_sync()
    partial: dict = {}
    for m in models:
        for name, grads in m.partial_grads.items():
            partial.setdefault(name, []).extend(grads)
    for name in sorted(partial):
        if dims.size(name) > 1:
            _all_reduce_flat(partial[name], dims.group(name))
    tied = [p for m in models for p in m.tied_params]
    if dims.pp > 1 and dims.embedding_group is not None and not models[0].tied_checked:
        _check_tied_embedding(len(tied), dims, models[0].grad_buffer.device)
        models[0].tied_checked = True
    for p in tied:
        if dims.size(spec_of(p).tied) > 1:
            dist.all_reduce(p.main_grad, group=dims.group(spec_of(p).tied))
    if num_tokens is not None:
        total = global_token_count(num_tokens, dims, models[0].grad_buffer.device)
        for m in models:
            m.scale_grads(1.0 / total.clamp(min=1))


def global_token_count(num_tokens, dims: ParallelDims, device) -> torch.Tensor:
    """The step's loss-token count over the pipeline (from its last stage) and data x context
    parallelism, as a 0-d fp64 tensor on ``device`` (exact far beyond fp32's 2^24)."""
    n = torch.as_tensor(num_tokens, device=device).detach().to(torch.float64).reshape(()).clone()
    if dims.pp > 1:
        dist.broadcast(n, src=dims.pp_peer(dims.pp - 1 - dims.pp_rank), group=dims.pp_group)
    if dims.dp_cp > 1:
        dist.all_reduce(n, group=dims.dp_cp_group)
    return n


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def _check_tied_embedding(count: int, dims: ParallelDims, device) -> None:
    """Once per run: the first and last pipeline stage must hold the same number of tied copies
    (``ShardSpec.tied``), or the all-reduce above would hang."""
    lo = torch.tensor([count], device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=dims.embedding_group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=dims.embedding_group)
    if lo.item() != hi.item():
        raise RuntimeError(
            f"the first and last pipeline stages hold {lo.item()} and {hi.item()} tied parameters: the first "
            "stage's word embedding and the last stage's output-layer copy both need ShardSpec.tied = "
            "'embedding' (their gradients are summed over the embedding group)")

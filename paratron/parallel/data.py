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

from . import comm, zero
from .dims import ParallelDims
from .linear import fusable_weights
from ..kernels.accumulate import accumulate_
from .sharding import norm_groups, spec_of, update_spec
from ..config.values import sharding_level
from .finalize import finalize_model_grads, global_token_count  # noqa: F401  (their home was this module)

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
        self.grad_full = self.param_full = None  # ZeRO-2/3: the bucket's own full storage (zero.py)
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
                 first_index: int = 0, level: Optional[int] = None, unit_of: Optional[dict] = None):
        """``level``: what is sharded (paratron/config/values.py sharding_level; default 1 with
        ``distributed``, else 0); a one-rank group shards nothing more than ZeRO-1. ``unit_of``: {parameter:
        ZeRO-3 unit}, where buckets are cut (paratron/parallel/zero.py)."""
        self.params, self.grad_group, self.tied = params, grad_group, tied
        self.group = dims.group(grad_group)
        self.n, self.rank = comm.group_size(self.group), comm.group_rank(self.group)
        level = int(distributed) if level is None else level
        self.level = level if self.n > 1 else min(level, 1)
        # Megatron averages dense and expert gradients alike over data x context parallelism (an
        # expert's gradient already sums the tokens its EP peers sent it); none with per-token loss.
        self.divisor = dims.size("dp_cp") if average else 1
        self.norm_groups = norm_groups(grad_group, distributed)
        self.buckets, self.offsets, total = self._layout(bucket_size, first_index,
                                                         unit_of if self.level == 3 else None)
        device = params[0].device
        self.grad_data = self.param_data = self.grad_shard_data = self.param_shard_data = None
        if self.level >= 2:  # full gradients per bucket, only during a step (zero.py); the shard stays
            self.grad_shard_data = torch.zeros(total // self.n, dtype=grad_dtype, device=device)
            for b in self.buckets:
                b.grad_full = torch.zeros(b.numel, dtype=grad_dtype, device=device)
        else:
            self.grad_data = torch.zeros(total, dtype=grad_dtype, device=device)
        if distributed:
            dtypes = {p.dtype for p in params}
            if len(dtypes) > 1:
                raise ValueError(f"the distributed optimizer needs one parameter dtype, got {sorted(map(str, dtypes))}")
            if self.level == 3:
                self.param_shard_data = torch.zeros(total // self.n, dtype=params[0].dtype, device=device)
                for b in self.buckets:
                    b.param_full = torch.zeros(b.numel, dtype=params[0].dtype, device=device)
            else:
                self.param_data = torch.zeros(total, dtype=params[0].dtype, device=device)
        self._place(params)

    def _place(self, params: list) -> None:
        """Point each parameter's ``main_grad`` (and ``data``, distributed) into the buffer; under ZeRO-2/3
        keep only the shards."""
        bucket = {p: b for b in self.buckets for p in b.params}
        with torch.no_grad():
            for p in params:
                b = bucket[p]
                off = self.offsets[p] - b.start
                p.main_grad = self.grad_full(b)[off: off + p.numel()].view_as(p)
                if self.level >= 1:
                    view = self.param_full(b)[off: off + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view
            for b in self.buckets:
                if self.level == 3:
                    lo, hi = b.shard_range()
                    self.param_shard(b).copy_(b.param_full[lo - b.start: hi - b.start])
                    zero.free(b.param_full)
                if self.level >= 2:
                    zero.free(b.grad_full)

    def grad_full(self, b: "Bucket") -> torch.Tensor:
        """The bucket's whole gradient (under ZeRO-2/3 only between its first gradient and its reduction)."""
        return b.grad_full if self.grad_data is None else self.grad_data[b.start: b.end]

    def param_full(self, b: "Bucket") -> torch.Tensor:
        return b.param_full if self.param_data is None else self.param_data[b.start: b.end]

    def _shard(self, data: Optional[torch.Tensor], full: Optional[torch.Tensor], b: "Bucket") -> torch.Tensor:
        if data is not None:  # the shard storage of ZeRO-2/3: bucket after bucket
            return data[b.start // self.n: b.end // self.n]
        lo, hi = b.shard_range()
        return full[lo: hi]

    def grad_shard(self, b: "Bucket") -> torch.Tensor:
        """This rank's shard of the bucket's reduced gradient."""
        return self._shard(self.grad_shard_data, self.grad_data, b)

    def param_shard(self, b: "Bucket") -> torch.Tensor:
        """This rank's shard of the bucket's parameters (what the distributed optimizer updates)."""
        return self._shard(self.param_shard_data, self.param_data, b)

    def reduced_grads(self) -> list[torch.Tensor]:
        """The storage of the gradients after the reduction (scaled with --calculate-per-token-loss)."""
        return [self.grad_data if self.grad_shard_data is None else self.grad_shard_data]

    def ensure_grads(self, b: "Bucket") -> None:
        """ZeRO-2/3: the bucket's full gradient storage, zeroed, at its first gradient of the step."""
        if self.level >= 2 and zero.allocate(b.grad_full):
            b.grad_full.zero_()

    def gather_params(self, b: "Bucket") -> int:
        """ZeRO-3: all-gather the bucket's parameters unless they are gathered; returns 1 if it gathered.
        The parameters' version counter is kept: autograd's saved views of them read the gathered values."""
        if not zero.allocate(b.param_full):
            return 0
        with torch.autograd._unsafe_preserve_version_counter(b.param_full):
            _all_gather(b.param_full, self.param_shard(b), group=self.group)
        return 1

    def _layout(self, bucket_size: Optional[int], first_index: int, unit_of: Optional[dict] = None):
        """Buckets over the parameters in reverse order (the order backward produces their
        gradients), each start aligned to ALIGN elements, each bucket padded to ALIGN x n so that it
        splits into equal aligned shards (and, with ``unit_of``, cut where the unit changes); returns
        (buckets, offsets, total size)."""
        buckets, offsets, current = [], {}, []
        start = pos = 0
        for p in reversed(self.params):
            if current and unit_of is not None and unit_of[p] != unit_of[current[-1]]:
                end = _round_up(pos, ALIGN * self.n)
                buckets.append(Bucket(first_index + len(buckets), self, current, start, end))
                start, pos, current = end, end, []
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
        g = self.grad_full(b)
        if self.divisor != 1:
            g.div_(self.divisor)  # Megatron scales before the collective
        if self.n == 1:
            return
        if self.level >= 1:
            b.grad_work = _reduce_scatter(self.grad_shard(b), g, group=self.group, async_op=True)
        else:
            b.grad_work = dist.all_reduce(g, group=self.group, async_op=True)

    def finish_grad_reduce(self, b: Bucket) -> None:
        if b.grad_work is not None:
            b.grad_work.wait()
            b.grad_work = None
        if self.level >= 2:
            zero.free(b.grad_full)

    def start_param_gather(self, b: Bucket) -> None:
        b.gather_work = _all_gather(self.param_full(b), self.param_shard(b), group=self.group, async_op=True)


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
                 average: bool = True, fuse_wgrad: bool = False, fused_accumulate: bool = True,
                 sharding: Optional[int] = None):
        """``sharding``: 2 (ZeRO-2) or 3 (ZeRO-3) shard the gradients, and the parameters with 3
        (paratron/parallel/zero.py); default: 1 with ``use_distributed_optimizer`` (ZeRO-1), else 0."""
        super().__init__()
        self.module, self.dims = module, dims
        self.overlap_grad_reduce = overlap_grad_reduce
        self.sharding = int(use_distributed_optimizer) if sharding is None else sharding
        self.use_distributed_optimizer = use_distributed_optimizer = self.sharding >= 1
        self.is_last_microbatch = True  # the schedule sets it False (no_sync) on the other micro-batches
        self.buckets_launched_in_backward = 0  # counted per step, for tests and logs
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._build_buffers(grad_dtype, bucket_size, average)
        self.buckets = [b for buf in self.buffers_ for b in buf.buckets]
        # what finalize_model_grads does after the reduction, read off the specs once: the gradients to sum
        # over a group (ShardSpec.sum_over), the tied copies' (the parts of them this rank holds)
        self.partial_grads: dict[str, list] = {}
        for p in self.params:
            for name in spec_of(p).sum_over:
                self.partial_grads.setdefault(name, []).extend(zero.grad_views(self.buffer_of_param(p), p))
        self.tied_params = [p for p in self.params if spec_of(p).tied is not None]
        self.tied_grads = [(spec_of(p).tied, g) for p in self.tied_params
                           for g in zero.grad_views(self.buffer_of_param(p), p)]
        self.tied_checked = False  # the pipeline stages agreed on their tied copies (once per run)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self.overlap_param_gather = (overlap_param_gather and use_distributed_optimizer
                                     and any(buf.n > 1 for buf in self.buffers_))
        self._unwritten: set = set()
        self.units = None  # ZeRO-3: the per-unit gathering (zero.py)
        if any(buf.level >= 2 for buf in self.buffers_):
            self.units = zero.ParamUnits(module, self._bucket_of, self._unit_of,
                                         any(buf.level == 3 for buf in self.buffers_))
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

    def _build_buffers(self, grad_dtype: torch.dtype, bucket_size: Optional[int], average: bool) -> None:
        """One GradBuffer per key of buffer_keys (ZeRO-3: buckets cut at the units of zero.py)."""
        self._unit_of = zero.unit_index(self.module, self.params) if self.sharding >= 2 else None
        self.buffers_: list[GradBuffer] = []
        for (group, tied), params in buffer_keys(self.params).items():
            size = bucket_size
            if size is None and self.overlap_grad_reduce:
                size = max(DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK * self.dims.size(group))
            first = sum(len(b.buckets) for b in self.buffers_)
            self.buffers_.append(GradBuffer(params, self.dims, group, tied, grad_dtype=grad_dtype, bucket_size=size,
                                            distributed=self.sharding >= 1, average=average, first_index=first,
                                            level=self.sharding, unit_of=self._unit_of))

    def buffer_of_param(self, p: torch.Tensor) -> GradBuffer:
        return next(buf for buf in self.buffers_ if p in buf.offsets)

    @property
    def grad_buffers(self) -> list[GradBuffer]:
        return self.buffers_

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The storage of the dense parameters' gradients (the first buffer; its shard under ZeRO-2/3)."""
        return self.buffers_[0].reduced_grads()[0]

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
        b = self._bucket_of[p]
        b.buffer.ensure_grads(b)
        if p not in self.fused_wgrad:
            accumulate_(p.main_grad, p.grad, write=p in self._unwritten, fused=self._fused_accumulate)
        self._unwritten.discard(p)
        p.grad = None
        if self.units is not None:
            self.units.on_grad(p)
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
            b = self._bucket_of[p]
            b.buffer.ensure_grads(b)
            p.main_grad.zero_()
        self._unwritten.clear()
        for b in self.buckets:
            if b.grad_work is None:  # not launched in backward (or a one-rank group: scaled only)
                b.buffer.start_grad_reduce(b)
        for b in self.buckets:
            b.buffer.finish_grad_reduce(b)

    def zero_grad_buffer(self) -> None:
        """Start a step. Instead of zero-filling the buffers, each parameter's first gradient is
        copied in (saves a write and a read of the whole buffer); finish_grad_sync zeroes the rest. The
        weights whose backward adds to main_grad (``fused_wgrad``) are zeroed here, in one launch.
        Padding between parameters is zero from construction and never written."""
        zeroed = [p.main_grad for p in self.fused_wgrad if self._bucket_of[p].buffer.level < 2]
        if zeroed:  # (ZeRO-2/3: zeroed when their bucket gets its storage, zero.py)
            torch._foreach_zero_(zeroed)
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
            for t in buf.reduced_grads():
                t.mul_(factor)

    # ---- parameters (distributed optimizer) -----------------------------------------------------
    def start_param_sync(self) -> None:
        """All-gather every bucket's updated shards; in the background with overlap_param_gather. ZeRO-3:
        drop the gathered parameters instead (stale now; each unit gathers its own when it runs)."""
        if self.units is not None:
            self.units.free_all()
        if not self.use_distributed_optimizer:
            return
        for b in reversed(self.buckets):  # the first layers' bucket first: the forward needs it first
            if b.buffer.n > 1 and b.buffer.level < 3:
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

    @contextmanager
    def gathered(self):
        """Every parameter whole for the block (ZeRO-3 gathers them all, then frees them; changes made
        to them are not kept, the shards are the parameters)."""
        self.finish_param_sync()
        if self.units is None:
            yield self.module
            return
        self.units.gather_all()
        try:
            yield self.module
        finally:
            self.units.free_all()

    def state_dict(self, *args, **kwargs):
        with self.gathered():
            sd = self.module.state_dict(*args, **kwargs)
            return sd if self.units is None else {k: v.detach().clone() for k, v in sd.items()}

    def load_state_dict(self, *args, **kwargs):
        if self.units is not None:
            raise RuntimeError("a ZeRO-3 model loads its parameters from a checkpoint's pieces "
                               "(paratron.checkpoint.sharded.load); load_state_dict would only fill gathered copies")
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
                        overlap_param_gather=par.overlap_param_gather, sharding=sharding_level(par),
                        average=not cfg.train.calculate_per_token_loss,
                        fuse_wgrad=not par.no_gradient_accumulation_fusion,
                        fused_accumulate=cfg.kernels.kernel_fused_accumulate != "off")

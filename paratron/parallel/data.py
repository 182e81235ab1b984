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

Sharded gradients and parameters (ZeRO-2/3, ``--use-megatron-fsdp --data-parallel-sharding-strategy``): the
same buffers keep only this rank's shard between steps; paratron/parallel/zero.py says when a bucket's full
gradients and parameters exist. The buffers themselves are in paratron/parallel/buffers.py, the fix-ups
after the reduction in paratron/parallel/finalize.py.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from . import fp8_gather, zero
from .buffers import ALIGN, DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK, Bucket, GradBuffer  # noqa: F401
from .dims import ParallelDims
from .finalize import finalize_model_grads, global_token_count  # noqa: F401  (their home was this module)
from .linear import fusable_weights
from ..kernels.accumulate import accumulate_
from .sharding import spec_of, update_spec
from ..config.values import bucket_end_multiple, sharding_level


def _weak_on_grad(dp: "DataParallel"):
    """``dp._on_grad`` as a hook that does not keep ``dp`` alive."""
    ref = weakref.ref(dp)

    def hook(p: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad(p)
    return hook


def buffer_keys(params: list, fp8: frozenset = frozenset()) -> dict:
    """{(grad group, tied group, in fp8): parameters, in module order}: one gradient buffer each. A tied
    parameter gets a buffer of its own so that both pipeline copies are sharded identically over
    data parallelism (the sum over the embedding group after a reduce-scatter relies on it); so do the
    FP8 weights gathered in FP8 (``fp8``, --fp8-param-gather)."""
    keys: dict = {}
    for p in params:
        spec = spec_of(p)
        keys.setdefault((spec.grad_group, spec.tied, p in fp8), []).append(p)
    return dict(sorted(keys.items(), key=lambda kv: (kv[0][0] != "dp_cp", kv[0][1] is not None, kv[0][2])))


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, dims: ParallelDims, *, grad_dtype: torch.dtype = torch.float32,
                 bucket_size: Optional[int] = None, overlap_grad_reduce: bool = False,
                 use_distributed_optimizer: bool = False, overlap_param_gather: bool = False,
                 average: bool = True, fuse_wgrad: bool = False, fused_accumulate: bool = True,
                 sharding: Optional[int] = None, fp8_param_gather: bool = False, bucket_end_multiple: int = 1):
        """``sharding``: 2 (ZeRO-2) or 3 (ZeRO-3) shard the gradients, and the parameters with 3
        (paratron/parallel/zero.py); default: 1 with ``use_distributed_optimizer`` (ZeRO-1), else 0.
        ``fp8_param_gather``: the FP8 linear weights are all-gathered in FP8 (paratron/parallel/fp8_gather.py).
        ``bucket_end_multiple``: every bucket's size a multiple of it too (see GradBuffer)."""
        super().__init__()
        self.module, self.dims = module, dims
        self.overlap_grad_reduce = overlap_grad_reduce
        self.sharding = int(use_distributed_optimizer) if sharding is None else sharding
        self.use_distributed_optimizer = use_distributed_optimizer = self.sharding >= 1
        self.is_last_microbatch = True  # the schedule sets it False (no_sync) on the other micro-batches
        self.buckets_launched_in_backward = 0  # counted per step, for tests and logs
        self.params = [p for p in module.parameters() if p.requires_grad]
        fp8 = frozenset(fp8_gather.fp8_weights(module)) if fp8_param_gather and self.sharding >= 1 else frozenset()
        self.bucket_end_multiple = bucket_end_multiple
        self._build_buffers(grad_dtype, bucket_size, average, fp8)
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
                                     and any(buf.n > 1 and buf.level < 3 for buf in self.buffers_))
        self._unwritten: set = set()
        self.units = None  # ZeRO-3: the per-unit gathering (zero.py)
        if any(buf.level >= 2 for buf in self.buffers_):
            self.units = zero.ParamUnits(module, self._bucket_of, self._unit_of,
                                         any(buf.level == 3 for buf in self.buffers_), overlap_param_gather)
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

    def _build_buffers(self, grad_dtype: torch.dtype, bucket_size: Optional[int], average: bool,
                       fp8: frozenset) -> None:
        """One GradBuffer per key of buffer_keys (ZeRO-3: buckets cut at the units of zero.py)."""
        self._unit_of = zero.unit_index(self.module, self.params) if self.sharding >= 2 else None
        self.buffers_: list[GradBuffer] = []
        for (group, tied, in_fp8), params in buffer_keys(self.params, fp8).items():
            size = bucket_size
            if size is None and self.overlap_grad_reduce:
                size = max(DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK * self.dims.size(group))
            first = sum(len(b.buckets) for b in self.buffers_)
            self.buffers_.append(GradBuffer(params, self.dims, group, tied, grad_dtype=grad_dtype, bucket_size=size,
                                            distributed=self.sharding >= 1, average=average, first_index=first,
                                            level=self.sharding, unit_of=self._unit_of, fp8=in_fp8,
                                            end_multiple=self.bucket_end_multiple))

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

    def step_state(self) -> frozenset:
        """What a step's backward passes leave on the host (the parameters that got no gradient): a CUDA graph
        replaying the step (train/step_graph.py) sets it back with :meth:`set_step_state` after each replay."""
        return frozenset(self._unwritten)

    def set_step_state(self, state: frozenset) -> None:
        self._unwritten = set(state)

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


def split_size(chunks: list, num_buckets: int) -> int:
    """Elements per bucket when ``chunks``' trained parameters go into ``num_buckets`` buckets (Megatron's sizing)."""
    return max(sum(p.numel() for m in chunks for p in m.parameters() if p.requires_grad) // num_buckets, 1)


def bucket_size_of(par, chunks: list) -> Optional[int]:
    """--ddp-bucket-size, or with --ddp-num-buckets N this rank's trained parameters (of every model chunk) / N."""
    return par.ddp_bucket_size if par.ddp_num_buckets is None else split_size(chunks, par.ddp_num_buckets)


def wrap_data_parallel(module: nn.Module, cfg, dims: ParallelDims, bucket_size: Optional[int]) -> DataParallel:
    """DataParallel configured from the run's flags (``bucket_size``: :func:`bucket_size_of` the rank's chunks)."""
    par = cfg.parallel
    return DataParallel(module, dims, grad_dtype=grad_buffer_dtype(cfg), bucket_size=bucket_size,
                        overlap_grad_reduce=par.overlap_grad_reduce,
                        use_distributed_optimizer=par.use_distributed_optimizer,
                        overlap_param_gather=par.overlap_param_gather, sharding=sharding_level(par),
                        fp8_param_gather=par.fp8_param_gather,
                        average=not cfg.train.calculate_per_token_loss,
                        fuse_wgrad=not par.no_gradient_accumulation_fusion,
                        fused_accumulate=cfg.kernels.kernel_fused_accumulate != "off",
                        bucket_end_multiple=bucket_end_multiple(par.ddp_pad_buckets_for_high_nccl_busbw))


def wrap_chunks(chunks: list, cfg, dims: ParallelDims) -> list[DataParallel]:
    """Each model chunk of this rank in its DataParallel, the buckets sized over all of them (--ddp-num-buckets)."""
    size = bucket_size_of(cfg.parallel, chunks)
    return [wrap_data_parallel(m, cfg, dims, size) for m in chunks]

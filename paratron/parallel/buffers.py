"""The gradient buffers of data parallelism (paratron/parallel/data.py has the whole story): a
:class:`GradBuffer` holds the gradients (and, with the distributed optimizer, the parameters) of the
parameters reduced alike, contiguous and cut into :class:`Bucket` s; under ZeRO-2/3 each bucket's full
storage lives only while needed and the buffer keeps this rank's shard (paratron/parallel/zero.py)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from . import comm, fp8_gather, zero
from .dims import ParallelDims
from .sharding import norm_groups

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
                 first_index: int = 0, level: Optional[int] = None, unit_of: Optional[dict] = None,
                 fp8: bool = False, end_multiple: int = 1):
        """``level``: what is sharded (paratron/config/values.py sharding_level; default 1 with
        ``distributed``, else 0); a one-rank group shards nothing more than ZeRO-1. ``unit_of``: {parameter:
        ZeRO-3 unit}, where buckets are cut (paratron/parallel/zero.py). ``fp8``: FP8 linear weights, gathered in
        FP8 (--fp8-param-gather, paratron/parallel/fp8_gather.py). ``end_multiple``: each bucket's size is also a
        multiple of it (--ddp-pad-buckets-for-high-nccl-busbw: 2^16)."""
        self.params, self.grad_group, self.tied, self.fp8 = params, grad_group, tied, fp8
        self.group = dims.group(grad_group)
        self.n, self.rank = comm.group_size(self.group), comm.group_rank(self.group)
        level = int(distributed) if level is None else level
        self.level = level if self.n > 1 else min(level, 1)
        # Megatron averages dense and expert gradients alike over data x context parallelism (an
        # expert's gradient already sums the tokens its EP peers sent it); none with per-token loss.
        self.divisor = dims.size("dp_cp") if average else 1
        self.norm_groups = norm_groups(grad_group, distributed)
        self.end_unit = math.lcm(ALIGN * self.n, end_multiple)  # what every bucket's size is a multiple of
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

    def gather_params(self, b: "Bucket", async_op: bool = False) -> int:
        """ZeRO-3: all-gather the bucket's parameters unless they are gathered (or wait for a prefetch of
        them: ``async_op`` starts one); returns 1 if it started a gather. The parameters' version counter
        is kept: autograd's saved views of them read the gathered values."""
        if b.gather_work is not None:
            if not async_op:
                b.gather_work.wait()
                b.gather_work = None
            return 0
        if not zero.allocate(b.param_full):
            return 0
        with torch.autograd._unsafe_preserve_version_counter(b.param_full):
            if self.fp8:  # (at once: the dequantisation follows the gather)
                fp8_gather.gather(self, b, b.param_full)
            else:
                b.gather_work = _all_gather(b.param_full, self.param_shard(b), group=self.group, async_op=async_op)
        return 1

    def free_params(self, b: "Bucket") -> None:
        """ZeRO-3: drop the bucket's gathered parameters (after any gather of them in flight)."""
        if b.gather_work is not None:
            b.gather_work.wait()
            b.gather_work = None
        zero.free(b.param_full)

    def _layout(self, bucket_size: Optional[int], first_index: int, unit_of: Optional[dict] = None):
        """Buckets over the parameters in reverse order (the order backward produces their
        gradients), each start aligned to ALIGN elements, each bucket padded to ALIGN x n (``end_unit``) so that
        it splits into equal aligned shards (and, with ``unit_of``, cut where the unit changes); returns
        (buckets, offsets, total size)."""
        buckets, offsets, current = [], {}, []
        start = pos = 0
        for p in reversed(self.params):
            if current and unit_of is not None and unit_of[p] != unit_of[current[-1]]:
                end = _round_up(pos, self.end_unit)
                buckets.append(Bucket(first_index + len(buckets), self, current, start, end))
                start, pos, current = end, end, []
            pos = _round_up(pos, ALIGN)
            offsets[p] = pos
            pos += p.numel()
            current.append(p)
            if bucket_size is not None and pos - start >= bucket_size:
                end = _round_up(pos, self.end_unit)
                buckets.append(Bucket(first_index + len(buckets), self, current, start, end))
                start, pos, current = end, end, []
        if current:
            end = _round_up(pos, self.end_unit)
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
        if self.fp8:  # at once (fp8_gather.py)
            fp8_gather.gather(self, b, self.param_full(b))
            return
        b.gather_work = _all_gather(self.param_full(b), self.param_shard(b), group=self.group, async_op=True)

"""The distributed optimizer (ZeRO-1, Megatron's ``--use-distributed-optimizer``).

Each data-parallel rank of a gradient buffer's group (see paratron/parallel/data.py) owns one equal
shard of every bucket of that buffer. After the reduce-scatter, the rank holds the summed gradient
of its shard only; it keeps fp32 masters and Adam moments for that shard only, steps them, writes
the result into its shard of the buffer's contiguous parameter storage, and the buckets are
all-gathered so that every rank has the full updated parameters again.

A shard cuts through parameters: this rank's part of a parameter is a *piece*, a contiguous range
of its flattened elements. Masters, gradients and Adam states are 1-D tensors, one per piece. For
fp32 parameters the master of a piece is a view of the parameter storage itself (no copy), as in
Megatron; for bf16/fp16 parameters it is an fp32 copy.

The gradient norm is the square root of the sum over this rank's pieces (each element counted on
one model-parallel rank, see ShardSpec.counts_in_norm), summed over each buffer's norm groups (its
data-parallel group, then its model-parallel group).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Config
from ..parallel.data import DataParallel, GradBuffer
from ..parallel.dims import ParallelDims
from ..parallel.sharding import spec_of
from . import offload
from .groups import role_of
from .muon import Item, Muon, qkv_rows
from .optimizer import MixedPrecisionAdam


@dataclass
class Piece:
    model: int  # index of the model chunk
    buffer: GradBuffer
    param: torch.nn.Parameter
    lo: int  # this rank's range in the buffer's storage
    hi: int
    bucket: object = None  # the Bucket it lies in

    def _shard(self, shard: torch.Tensor) -> torch.Tensor:
        return shard[self.lo - self.bucket.shard_range()[0]: self.hi - self.bucket.shard_range()[0]]

    def grad(self) -> torch.Tensor:
        """The piece of the reduced gradient (the buffer's shard storage under ZeRO-2/3)."""
        return self._shard(self.buffer.grad_shard(self.bucket))

    def data(self) -> torch.Tensor:
        """The piece of the parameters this rank updates (the shard storage under ZeRO-3)."""
        return self._shard(self.buffer.param_shard(self.bucket))

    @property
    def start(self) -> int:
        """The piece's first element in the flattened parameter."""
        return self.lo - self.buffer.offsets[self.param]


def shard_pieces(models: list[DataParallel]) -> list[Piece]:
    """This rank's pieces of every parameter, in buffer order."""
    pieces = []
    for i, m in enumerate(models):
        for buf in m.grad_buffers:
            for b in buf.buckets:
                lo, hi = b.shard_range()
                for p in b.params:
                    start = buf.offsets[p]
                    a, z = max(lo, start), min(hi, start + p.numel())
                    if a < z:
                        pieces.append(Piece(i, buf, p, a, z, b))
    return pieces


def bucket_of(pc: Piece):
    return pc.bucket


def muon_buckets(models: list[DataParallel], names: dict, op) -> dict:
    """{bucket: [(parameter, name) Muon steps]} of every bucket holding Muon matrices, in buffer order
    (the same on every rank of a bucket's group: they hold the same layout)."""
    out = {}
    for m in models:
        for buf in m.grad_buffers:
            for b in buf.buckets:
                ps = [(p, names[p]) for p in b.params if role_of(names[p], p.dim(), op).matrix]
                if ps:
                    out[b] = ps
    return out


class DistributedOptimizer(MixedPrecisionAdam):
    def __init__(self, models: list[DataParallel], cfg: Config, dims: ParallelDims):
        for m in models:
            if any(buf.param_data is None and buf.param_shard_data is None for buf in m.grad_buffers):
                raise ValueError("the distributed optimizer needs the model wrapped with use_distributed_optimizer=True")
        self.models, self.dims = models, dims
        self.pieces = shard_pieces(models)
        self.mixed = any(pc.param.dtype != torch.float32 for pc in self.pieces)
        with torch.no_grad():
            self._param_views = [pc.data() for pc in self.pieces]
            self._grad_views = [pc.grad() for pc in self.pieces]
            masters = [v.detach().float().clone() if v.dtype != torch.float32 else v.detach()
                       for v in self._param_views]
        names = {p: name for m in models for name, p in m.named_parameters()}
        roles = [role_of(names[pc.param], pc.param.dim(), cfg.optim, cfg.model) for pc in self.pieces]
        items = [Item(m, pc.param, names[pc.param], pc.start, bucket_of(pc)) if r.matrix else None
                 for m, pc, r in zip(masters, self.pieces, roles)]
        self._setup(masters, roles, [pc.buffer.norm_groups for pc in self.pieces],
                    [spec_of(pc.param).counts_in_norm(dims) for pc in self.pieces], cfg, dims, items)
        buckets = muon_buckets(models, names, cfg.optim) if cfg.optim.optimizer == "muon" else {}
        if buckets and self.muon is None:  # no piece of a matrix here, but the bucket gathers need this rank
            self.muon = Muon([], cfg.optim, dims, qkv_rows(cfg.model))
        if self.muon is not None:
            self.muon.set_buckets(buckets)

    def _grads(self) -> list[torch.Tensor]:
        return [g if g.dtype == torch.float32 else g.float() for g in self._grad_views]

    def _native_grads(self) -> list[torch.Tensor]:
        return list(self._grad_views)

    def _model_tensors(self) -> list:
        return self._param_views

    def _model_weights(self) -> list:
        return [v if v.dtype != torch.float32 else None for v in self._param_views]

    def _publish(self, copied: bool = False) -> None:
        if self.mixed and not copied:
            offload.copy_all(self._param_views, self.masters)
        for m in self.models:
            m.start_param_sync()

    def _own_masters(self) -> list[torch.Tensor]:
        return self.masters if self.mixed else []

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy this rank's shard of the model's parameters into the masters (after loading weights)."""
        for m in self.models:
            m.finish_param_sync()
        if self.mixed:
            offload.copy_all(self.masters, self._param_views)
        self.reload_offloaded()

"""Autograd-aware collectives for tensor and sequence parallelism.

Each function is a pair (forward collective, backward collective) over one process group. A group
of ``None`` or size 1 makes every function the identity, so the model code calls them
unconditionally and stays exactly a plain transformer at TP=1.

    copy_to_tp            fwd identity          bwd all-reduce          (input of a column-parallel layer)
    reduce_from_tp        fwd all-reduce        bwd identity            (output of a row-parallel layer)
    scatter_to_tp         fwd split last dim    bwd all-gather last dim
    gather_from_tp        fwd all-gather last   bwd split last dim
    scatter_to_sp         fwd split dim 0       bwd all-gather dim 0    (enter the sequence-parallel region)
    gather_from_sp        fwd all-gather dim 0  bwd reduce-scatter dim 0 (before a column-parallel layer)
    reduce_scatter_to_sp  fwd reduce-scatter 0  bwd all-gather dim 0    (after a row-parallel layer)
    unscatter_from_sp     fwd all-gather dim 0  bwd split dim 0         (inverse of scatter_to_sp)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.size(dim) % n:
        raise ValueError(f"cannot split dim {dim} of size {x.size(dim)} over {n} ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    if dim == 0:
        out = torch.empty((n * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter0(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.size(0) % n:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {x.size(0)} over {n} ranks")
    x = x.contiguous()
    out = torch.empty((x.size(0) // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone() if group_size(group) > 1 else x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, 0, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter0(g, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, 0, ctx.group), None


class _UnscatterFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, 0, ctx.group), None


def _wrap(fn):
    def call(x: torch.Tensor, group) -> torch.Tensor:
        if group_size(group) == 1:
            return x
        return fn.apply(x, group)
    call.__name__ = fn.__name__.lstrip("_")
    return call


copy_to_tp = _wrap(_CopyToTP)
reduce_from_tp = _wrap(_ReduceFromTP)
scatter_to_tp = _wrap(_ScatterToTP)
gather_from_tp = _wrap(_GatherFromTP)
scatter_to_sp = _wrap(_ScatterToSP)
gather_from_sp = _wrap(_GatherFromSP)
reduce_scatter_to_sp = _wrap(_ReduceScatterToSP)
unscatter_from_sp = _wrap(_UnscatterFromSP)

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
    all_to_all            fwd all-to-all dim 0  bwd all-to-all dim 0    (context parallelism's a2a: part j
                                                                         of dim 0 goes to rank j; its own inverse)
    unscatter_from_sp     fwd all-gather dim 0  bwd split dim 0         (inverse of scatter_to_sp)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.11 names the tensor-in/tensor-out collectives ``*_single`` and deprecates the older names
# (a FutureWarning on every rank of every TP/SP run); every module of paratron calls these two.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
        all_gather_single(out, x, group=group)
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
    reduce_scatter_single(out, x, group=group)
    return out


def _all_to_all0(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _all_reduce_copy(x: torch.Tensor, group) -> torch.Tensor:
    return all_reduce(x.clone(), group)


def _pair(name: str, forward, backward):
    """A collective as an autograd function: ``forward(x, group)``, whose gradient is
    ``backward(g, group)``; the identity for a group of one rank."""

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, g):
            return backward(g, ctx.group), None

    def call(x: torch.Tensor, group) -> torch.Tensor:
        if group_size(group) == 1:
            return x
        return Pair.apply(x, group)

    Pair.__name__ = Pair.__qualname__ = name
    call.__name__ = name
    return call


copy_to_tp = _pair("copy_to_tp", _identity, all_reduce)
reduce_from_tp = _pair("reduce_from_tp", _all_reduce_copy, _identity)
scatter_to_tp = _pair("scatter_to_tp", lambda x, g: _split(x, -1, g), lambda x, g: _gather(x, -1, g))
gather_from_tp = _pair("gather_from_tp", lambda x, g: _gather(x, -1, g), lambda x, g: _split(x, -1, g))
scatter_to_sp = _pair("scatter_to_sp", lambda x, g: _split(x, 0, g), lambda x, g: _gather(x, 0, g))
gather_from_sp = _pair("gather_from_sp", lambda x, g: _gather(x, 0, g), _reduce_scatter0)
reduce_scatter_to_sp = _pair("reduce_scatter_to_sp", _reduce_scatter0, lambda x, g: _gather(x, 0, g))
unscatter_from_sp = _pair("unscatter_from_sp", lambda x, g: _gather(x, 0, g), lambda x, g: _split(x, 0, g))
all_to_all = _pair("all_to_all", _all_to_all0, _all_to_all0)  # part j of dim 0 to rank j: its own inverse

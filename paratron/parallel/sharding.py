"""How each parameter is laid out over the ranks: one :class:`ShardSpec` per parameter.

A parameter is a piece of a *global* tensor (its shape in the one-rank model). The spec says

- ``splits``: which dimensions are cut over which process group. Along a split dimension the
  global size is a sequence of ``blocks`` (SwiGLU's ``[gate; up]`` is two blocks, a fused QKV with
  separate q/k/v would be three of unequal sizes); each block is cut into contiguous, as-equal-as-
  possible parts, one per rank of the group, and a rank's local dimension is its parts of every
  block, concatenated. Several dimensions may be split, each over its own group (an expert weight:
  experts over EP, rows over expert-TP).
- ``grad_group``: the data-parallel group its gradient is reduced over (``dp_cp`` for dense
  parameters; an expert parameter's would be the expert-data-parallel group ``edp``).
- ``sum_over``: model-parallel groups whose partial gradients must be summed after that reduction
  (a replicated norm weight applied to sequence-sharded activations: ``("tp",)``).
- ``tied``: the group over which this parameter and its copies are kept equal, their gradients
  summed (the word embedding and the last pipeline stage's output-layer copy: ``"embedding"``);
  ``copy_of`` names the parameter a copy stands for (the copy is saved under that name and not
  counted in the gradient norm).
- ``vocab_rows``: dimension 0 is the padded vocabulary (its padding may differ between layouts).
- ``wgrad_fusable``: every training use of the weight goes through the linear dispatch (parallel/linear.py) or
  code that honours ``fuse_wgrad`` (the gated MLP), so its gradient may be added to ``main_grad`` by the
  weight-gradient GEMM itself (set by the layer, ``mark_fusable``).
- ``fuse_wgrad``: it is (set by DataParallel, with Megatron's gradient-accumulation fusion on).

The parallel layers attach a spec when they create a parameter (``set_spec``); everything else
(gradient buffers, the norm, checkpoints, gathering a full tensor) reads it with :func:`spec_of`.
A parameter without a spec is replicated over every model-parallel group and reduced over dp_cp.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Optional

import torch

from .dims import ParallelDims

# Model-parallel axes, per gradient group: a parameter reduced over ``grad_group`` is either split
# or replicated along each of them, and its squared gradient norm is summed over ``norm_group``.
REDUCTION_LAYOUTS = {
    "dp_cp": {"model_axes": ("tp",), "norm_group": "mp"},
    "edp": {"model_axes": ("etp", "ep"), "norm_group": "emp"},
}


def norm_groups(grad_group: str, distributed: bool) -> tuple[str, ...]:
    """The groups a squared gradient norm of parameters reduced over ``grad_group`` is summed over:
    the model-parallel group of that layout, preceded by ``grad_group`` itself when the optimizer is
    sharded over it (each rank then holds one shard of the gradients)."""
    return ((grad_group,) if distributed else ()) + (REDUCTION_LAYOUTS[grad_group]["norm_group"],)


@dataclass(frozen=True)
class Split:
    dim: int
    group: str  # a ParallelDims group name: "tp", "ep", "etp", ...
    blocks: tuple[int, ...]  # global sizes of the blocks along ``dim``

    def parts(self, rank: int, size: int) -> list[tuple[int, int]]:
        """(global start, length) of each part this rank holds along ``dim``, in local order."""
        out, start = [], 0
        for b in self.blocks:
            lo, hi = rank * b // size, (rank + 1) * b // size
            if hi > lo:
                out.append((start + lo, hi - lo))
            start += b
        return out


@dataclass(frozen=True)
class ShardSpec:
    splits: tuple[Split, ...] = ()
    grad_group: str = "dp_cp"
    sum_over: tuple[str, ...] = ()
    tied: Optional[str] = None
    copy_of: Optional[str] = None
    vocab_rows: bool = False
    wgrad_fusable: bool = False
    fuse_wgrad: bool = False

    def split_of(self, dim: int) -> Optional[Split]:
        return next((s for s in self.splits if s.dim == dim), None)

    def is_split_over(self, group: str) -> bool:
        return any(s.group == group for s in self.splits)

    def global_shape(self, local_shape: tuple) -> tuple:
        shape = list(local_shape)
        for s in self.splits:
            shape[s.dim] = sum(s.blocks)
        return tuple(shape)

    def counts_in_norm(self, dims: ParallelDims) -> bool:
        """Whether this rank's copy enters the global gradient norm: each element exactly once over
        the model-parallel ranks (a replicated tensor on coordinate 0 of each axis it is replicated
        along; a pipeline copy of a tied parameter never)."""
        if self.copy_of is not None:
            return False
        axes = REDUCTION_LAYOUTS[self.grad_group]["model_axes"]
        return all(self.is_split_over(a) or dims.coordinate(a) == 0 for a in axes)

    def with_(self, **changes) -> "ShardSpec":
        return replace(self, **changes)


REPLICATED = ShardSpec()


def spec_of(p: torch.Tensor) -> ShardSpec:
    """The parameter's spec (replicated over model parallelism, reduced over dp_cp when none)."""
    return p.__dict__.get("_shard_spec", REPLICATED)


def set_spec(p: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    p._shard_spec = spec
    return p


def update_spec(p: torch.Tensor, **changes) -> torch.Tensor:
    return set_spec(p, spec_of(p).with_(**changes))


def local_index(split: Split, rank: int, size: int) -> torch.Tensor:
    """Global indices along ``split.dim`` of this rank's local elements, in local order."""
    return torch.cat([torch.arange(a, a + n) for a, n in split.parts(rank, size)])


def shard(full: torch.Tensor, spec: ShardSpec, coords: dict[str, tuple[int, int]]) -> torch.Tensor:
    """This rank's part of the global tensor ``full``. ``coords``: {group: (rank, size)}."""
    out = full
    for s in spec.splits:
        rank, size = coords.get(s.group, (0, 1))
        if size > 1:
            out = out.index_select(s.dim, local_index(s, rank, size).to(out.device))
    return out.contiguous()


def coords_of(spec: ShardSpec, dims: ParallelDims) -> dict[str, tuple[int, int]]:
    return {s.group: (dims.coordinate(s.group), dims.size(s.group)) for s in spec.splits}


# ---- rectangles of global tensors (checkpoints) ------------------------------------------------

def flat_rectangles(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """Elements [lo, hi) of a row-major tensor of ``shape`` as rectangles (offsets, sizes, flat
    start), each contiguous in the flattened tensor."""
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    r0, o0 = divmod(lo, inner)
    r1, o1 = divmod(hi, inner)

    def within(row: int, a: int, b: int) -> list:
        return [((row, *off), (1, *size), row * inner + start)
                for off, size, start in flat_rectangles(shape[1:], a, b)]

    if r0 == r1:
        return within(r0, o0, o1)
    out = []
    if o0:
        out += within(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner))
    if o1:
        out += within(r1, 0, o1)
    return out


def _global_ranges(split: Split, rank: int, size: int, a: int, n: int) -> list[tuple[int, int, int]]:
    """Local range [a, a + n) along a split dimension as (local start, global start, length) runs."""
    out, local = [], 0
    for g, length in split.parts(rank, size):
        lo, hi = max(a, local), min(a + n, local + length)
        if lo < hi:
            out.append((lo, g + lo - local, hi - lo))
        local += length
    return out


def global_rectangles(spec: ShardSpec, coords: dict[str, tuple[int, int]], offsets: tuple,
                      sizes: tuple) -> list[tuple[tuple, tuple, tuple]]:
    """A rectangle of the local tensor as rectangles of the global one:
    (local offsets, global offsets, sizes) each."""
    per_dim = []
    for d, (a, n) in enumerate(zip(offsets, sizes)):
        s = spec.split_of(d)
        rank, size = coords.get(s.group, (0, 1)) if s is not None else (0, 1)
        per_dim.append(_global_ranges(s, rank, size, a, n) if s is not None and size > 1 else [(a, a, n)])
    return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
            for combo in itertools.product(*per_dim)]

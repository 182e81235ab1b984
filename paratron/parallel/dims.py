"""ParallelDims: the sizes, this rank's coordinates and every process group, in one object.

Rank numbering follows Megatron's ``order="tp-cp-ep-dp-pp"``: the first axis varies fastest, so
``rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP`` for dense layers (EP does not split the dense layout).
``order="tp-cp-ep-pp-dp"`` (``--use-tp-pp-dp-mapping``) swaps the two outer axes:
``rank = tp + cp*TP + pp*TP*CP + dp*TP*CP*PP``, and the expert layout becomes ``tp-ep-pp-dp``.
Experts use a second layout ``tp-ep-dp-pp`` (expert-TP, EP, expert-DP) whose PP groups equal the
dense ones. Nothing here is module-level state: build one object per layout and pass it around.
A group is ``None`` when torch.distributed is not initialised (a one-process run); every
communication helper treats ``None`` or size 1 as "nothing to do".
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..config import ConfigError

DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")
# Megatron's two orders (--use-tp-pp-dp-mapping picks the second): the axes of each layout, fastest first
ORDERS = {"tp-cp-ep-dp-pp": (DENSE_AXES, EXPERT_AXES),
          "tp-cp-ep-pp-dp": (("tp", "cp", "pp", "dp"), ("etp", "ep", "pp", "edp"))}


@dataclass
class ParallelDims:
    world_size: int = 1
    rank: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: Optional[int] = None
    vpp_group: Optional[int] = None  # the interleaved schedule's micro-batch group size (None: PP)
    order: str = "tp-cp-ep-dp-pp"
    # this rank's coordinates
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0
    groups: dict = field(default_factory=dict)  # name -> ProcessGroup (absent/None: single rank)
    group_ranks: dict = field(default_factory=dict)  # name -> list of global ranks of this rank's group

    # ---- group accessors -------------------------------------------------------------
    def group(self, name: str):
        return self.groups.get(name)

    def size(self, name: str) -> int:
        """Number of ranks of this rank's group ``name`` (1 when it has none)."""
        return len(self.group_ranks.get(name, [self.rank]))

    def coordinate(self, name: str) -> int:
        """This rank's index in its group ``name`` (0 when it has none)."""
        ranks = self.group_ranks.get(name, [self.rank])
        return ranks.index(self.rank)

    @property
    def tp_group(self):
        return self.groups.get("tp")

    @property
    def pp_group(self):
        return self.groups.get("pp")

    @property
    def dp_group(self):
        return self.groups.get("dp")

    @property
    def cp_group(self):
        return self.groups.get("cp")

    @property
    def dp_cp_group(self):
        return self.groups.get("dp_cp")

    @property
    def mp_group(self):
        return self.groups.get("mp")

    @property
    def embedding_group(self):
        return self.groups.get("embedding")

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """Megatron logs on the last rank: last pipeline stage, tp/cp/dp rank = highest."""
        return self.rank == self.world_size - 1

    def pp_peer(self, offset: int) -> int:
        """Global rank of the pipeline stage ``offset`` stages away (wrapping)."""
        ranks = self.group_ranks.get("pp", [self.rank])
        return ranks[(self.pp_rank + offset) % self.pp]

    def describe(self) -> str:
        return (f"world {self.world_size} = TP {self.tp} x CP {self.cp} x DP {self.dp} x PP {self.pp}"
                + (f" (EP {self.ep}, expert-TP {self.etp})" if self.ep > 1 else ""))


def _coords(rank: int, sizes: dict[str, int], axes: tuple[str, ...]) -> dict[str, int]:
    out = {}
    for a in axes:
        out[a] = rank % sizes[a]
        rank //= sizes[a]
    return out


def _rank_of(coords: dict[str, int], sizes: dict[str, int], axes: tuple[str, ...]) -> int:
    r, stride = 0, 1
    for a in axes:
        r += coords[a] * stride
        stride *= sizes[a]
    return r


def layout_groups(world: int, sizes: dict[str, int], axes: tuple[str, ...], varying: tuple[str, ...]):
    """All rank lists of the groups whose members differ only along ``varying`` axes."""
    fixed = [a for a in axes if a not in varying]
    groups = []
    for fixed_vals in itertools.product(*[range(sizes[a]) for a in fixed]):
        base = dict(zip(fixed, fixed_vals))
        members = []
        for var_vals in itertools.product(*[range(sizes[a]) for a in reversed(varying)]):
            c = dict(base, **dict(zip(reversed(varying), var_vals)))
            members.append(_rank_of(c, sizes, axes))
        groups.append(sorted(members))
    assert sum(len(g) for g in groups) == world
    return groups


def _group_axes(sizes: dict, esizes: dict, order: str = "tp-cp-ep-dp-pp") -> dict:
    """{group name: (sizes, axes of the layout, the axes its members differ along)}."""
    dense, expert = ORDERS[order]
    return {
        "tp": (sizes, dense, ("tp",)),
        "cp": (sizes, dense, ("cp",)),
        "dp": (sizes, dense, ("dp",)),
        "pp": (sizes, dense, ("pp",)),
        "dp_cp": (sizes, dense, ("cp", "dp")),
        "tp_cp": (sizes, dense, ("tp", "cp")),
        "mp": (sizes, dense, ("tp", "pp")),
        "ep": (esizes, expert, ("ep",)),
        "etp": (esizes, expert, ("etp",)),
        "edp": (esizes, expert, ("edp",)),
        "etp_ep": (esizes, expert, ("etp", "ep")),  # the ranks holding one copy of every expert
        "emp": (esizes, expert, ("etp", "ep", "pp")),  # the experts' model-parallel group
    }


def _hierarchical_cp_groups(cp_groups: list, sizes: list, cp: int) -> dict:
    """The ``cp_a2a`` (A consecutive CP ranks) and ``cp_p2p`` (every A-th) groups of hierarchical sizes
    [A, P] within each CP group (its ranks in CP order)."""
    if len(sizes) != 2 or sizes[0] * sizes[1] != cp:
        raise ConfigError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: give two sizes (the "
                          f"all-to-all and the ring level) whose product is --context-parallel-size {cp}")
    a = sizes[0]
    return {"cp_a2a": [g[i:i + a] for g in cp_groups for i in range(0, cp, a)],
            "cp_p2p": [g[i::a] for g in cp_groups for i in range(a)]}


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: Optional[int] = None,
                              order: str = "tp-cp-ep-dp-pp", *, world_size: Optional[int] = None,
                              rank: Optional[int] = None, backend: Optional[str] = None,
                              timeout: Optional[timedelta] = None,
                              hierarchical_context_parallel_sizes: Optional[list] = None) -> ParallelDims:
    """Build the ParallelDims of this process (Megatron's signature). Works without torch.distributed
    when every size is 1. With torch.distributed initialised, every rank must call it (new_group is
    collective). ``timeout`` (``--distributed-timeout-minutes``) bounds every collective of every
    group, as Megatron's; each group carries its name as its ``group_desc`` (error messages use it).
    ``hierarchical_context_parallel_sizes`` [A, P] (A x P = CP) also builds the two levels of
    ``--cp-comm-type a2a+p2p``: ``cp_a2a``, A consecutive CP ranks, and ``cp_p2p``, the CP ranks that
    hold the same place in their ``cp_a2a`` group."""
    initialized = dist.is_available() and dist.is_initialized()
    world = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
    me = rank if rank is not None else (dist.get_rank() if initialized else 0)
    if order not in ORDERS:
        raise ConfigError(f"order {order!r} is not supported; paratron has Megatron's tp-cp-ep-dp-pp (the default) "
                          "and tp-cp-ep-pp-dp (--use-tp-pp-dp-mapping)")
    tp, pp, cp, ep = (tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
                      expert_model_parallel_size)
    etp = expert_tensor_parallel_size or tp
    model_size = tp * pp * cp
    if world % model_size:
        raise ConfigError(f"world size {world} is not divisible by TP {tp} x PP {pp} x CP {cp} = {model_size}; "
                          "change the parallel sizes or the number of processes")
    dp = world // model_size
    if (world // pp) % (etp * ep):
        raise ConfigError(f"world size {world} / PP {pp} is not divisible by expert-TP {etp} x EP {ep}")
    edp = world // (pp * etp * ep)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    esizes = {"etp": etp, "ep": ep, "edp": edp, "pp": pp}
    dense_axes, expert_axes = ORDERS[order]
    c = _coords(me, sizes, dense_axes)
    ec = _coords(me, esizes, expert_axes)
    dims = ParallelDims(world_size=world, rank=me, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp,
                        vpp=virtual_pipeline_model_parallel_size, order=order,
                        tp_rank=c["tp"], pp_rank=c["pp"], dp_rank=c["dp"], cp_rank=c["cp"],
                        ep_rank=ec["ep"], etp_rank=ec["etp"], edp_rank=ec["edp"])
    all_groups = {name: layout_groups(world, s, ax, var)
                  for name, (s, ax, var) in _group_axes(sizes, esizes, order).items()}
    if sorted(layout_groups(world, esizes, expert_axes, ("pp",))) != sorted(all_groups["pp"]):
        raise ConfigError(f"order {order}: the expert layout's pipeline groups differ from the dense ones; with "
                          f"PP {pp} the expert-TP {etp} x EP {ep} must equal TP {tp} x CP {cp}")
    if hierarchical_context_parallel_sizes:
        all_groups.update(_hierarchical_cp_groups(all_groups["cp"], hierarchical_context_parallel_sizes, cp))
    # embedding group: first and last stage of each pipeline (for tied embeddings)
    all_groups["embedding"] = [sorted({g[0], g[-1]}) for g in all_groups["pp"]]
    _make_groups(dims, all_groups, initialized, backend, timeout)
    return dims


def _make_groups(dims: ParallelDims, all_groups: dict, initialized: bool, backend, timeout) -> None:
    """Record this rank's group of each name and, with torch.distributed, create every group (new_group
    is collective: every rank calls it for every group, in the same order)."""
    me = dims.rank
    for name, rank_lists in all_groups.items():
        for ranks in rank_lists:
            if me in ranks:
                dims.group_ranks[name] = ranks
        if not initialized:
            continue
        for ranks in rank_lists:
            pg = (dist.new_group(ranks, backend=backend, timeout=timeout, group_desc=name) if len(ranks) > 1
                  else None)
            if me in ranks:
                dims.groups[name] = pg


def shutdown_distributed(synchronize: bool = True) -> None:
    """Destroy every process group. With ``synchronize`` (after a clean run) the ranks first meet at
    a barrier: a rank that tears its groups down and exits while a peer is still in its last
    collective makes gloo abort that peer ("terminate called without an active exception")."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if synchronize:
        dist.barrier()
    dist.destroy_process_group()

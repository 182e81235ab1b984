"""Megatron Core's ``parallel_state``: initialize_model_parallel and the group / rank / size getters,
over the one ParallelDims held by :data:`COMPAT` (the facade's compatibility object).

``initialize_model_parallel(tensor_model_parallel_size=2, ...)`` builds the ParallelDims of this process
(``paratron.parallel.dims.initialize_model_parallel``, same keyword arguments) and keeps it in ``COMPAT``;
every getter reads it from there. ``current_dims()`` hands the ParallelDims itself to code that wants
paratron's explicit objects. Only ``paratron.core`` reads ``COMPAT``.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import UserError
from ..parallel.dims import ParallelDims, initialize_model_parallel as _build_dims

# Megatron's keyword arguments that paratron accepts and ignores (they change no numbers on one host)
IGNORED = ("pipeline_model_parallel_comm_backend", "use_sharp", "nccl_communicator_config_path",
           "distributed_timeout_minutes", "create_gloo_process_groups", "use_tp_pp_dp_mapping",
           "high_priority_stream_groups", "sharp_enabled_group", "get_embedding_ranks", "get_position_embedding_ranks",
           "encoder_tensor_model_parallel_size", "encoder_pipeline_model_parallel_size",
           "num_distributed_optimizer_instances")


class Compat:
    """The facade's state: the ParallelDims of ``initialize_model_parallel`` and the seed of
    ``model_parallel_cuda_manual_seed``. One instance, :data:`COMPAT`; read by ``paratron.core`` only."""

    def __init__(self):
        self.dims: Optional[ParallelDims] = None
        self.seed: Optional[int] = None
        self.solo_group = None  # this rank alone, for the getters of the axes of size 1

    def require(self) -> ParallelDims:
        if self.dims is None:
            raise UserError("model parallel is not initialized: call paratron.core.parallel_state."
                            "initialize_model_parallel(...) after torch.distributed.init_process_group")
        return self.dims


COMPAT = Compat()


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              pipeline_model_parallel_split_rank: Optional[int] = None,
                              context_parallel_size: int = 1, hierarchical_context_parallel_sizes=None,
                              expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                              order: str = "tp-cp-ep-dp-pp", **megatron_only) -> ParallelDims:
    """Megatron's signature; returns the ParallelDims it keeps (paratron code can take it from here)."""
    unknown = sorted(set(megatron_only) - set(IGNORED))
    if unknown:
        raise TypeError(f"initialize_model_parallel() got an unexpected keyword argument {unknown[0]!r}")
    if pipeline_model_parallel_split_rank is not None:
        raise UserError("initialize_model_parallel(pipeline_model_parallel_split_rank=...): encoder-decoder "
                        "pipelines are not supported by paratron")
    if megatron_only.get("use_tp_pp_dp_mapping"):
        order = "tp-cp-ep-pp-dp"
    minutes = megatron_only.get("distributed_timeout_minutes")
    COMPAT.dims = _build_dims(tensor_model_parallel_size, pipeline_model_parallel_size,
                              virtual_pipeline_model_parallel_size, context_parallel_size,
                              expert_model_parallel_size, expert_tensor_parallel_size, order,
                              timeout=timedelta(minutes=minutes) if minutes else None,
                              hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes)
    return COMPAT.dims


def model_parallel_is_initialized() -> bool:
    return COMPAT.dims is not None


def destroy_model_parallel() -> None:
    """Forget the ParallelDims (its process groups stay with torch.distributed until
    ``destroy_process_group``); a later ``initialize_model_parallel`` builds a new one."""
    COMPAT.dims = COMPAT.seed = COMPAT.solo_group = None


def current_dims() -> ParallelDims:
    """The ParallelDims kept by ``initialize_model_parallel`` (paratron's explicit object)."""
    return COMPAT.require()


def _size(name: str) -> int:
    return COMPAT.require().size(name)


def _rank(name: str) -> int:
    return COMPAT.require().coordinate(name)


def _group(name: str):
    """The process group of axis ``name``. ParallelDims has none for an axis of size 1 (nothing to do); Megatron
    code passes the group to collectives, where None would mean every rank, so the facade hands out a group
    of this rank alone instead (made by this rank only: ``use_local_synchronization``)."""
    dims = COMPAT.require()
    group = dims.group(name)
    if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if COMPAT.solo_group is None:
            COMPAT.solo_group = dist.new_group([dims.rank], use_local_synchronization=True)
        return COMPAT.solo_group
    return group


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _group("tp")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _group("pp")


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return _size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return _rank("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    return _group("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_context_parallel_group(check_initialized: bool = True):
    return _group("cp")


def get_expert_model_parallel_world_size() -> int:
    return _size("ep")


def get_expert_model_parallel_rank() -> int:
    return _rank("ep")


def get_expert_model_parallel_group(check_initialized: bool = True):
    return _group("ep")


def get_model_parallel_group(check_initialized: bool = True):
    return _group("mp")


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return COMPAT.require().vpp


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """The first pipeline stage (with ``vp_stage`` and not ``ignore_virtual``: also its first model chunk)."""
    virtual_first = ignore_virtual or vp_stage is None or vp_stage == 0
    return COMPAT.require().is_first_stage and virtual_first


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """The last pipeline stage (with ``vp_stage`` and not ``ignore_virtual``: also its last model chunk)."""
    dims = COMPAT.require()
    virtual_last = ignore_virtual or vp_stage is None or vp_stage == (dims.vpp or 1) - 1
    return dims.is_last_stage and virtual_last

"""Megatron Core's ``finalize_model_grads(model)``: paratron's (paratron/parallel/data.py) for the
ParallelDims of ``parallel_state``: the data-parallel reduction, the sums over tensor parallelism of
sequence-parallel replicated parameters and of tied pipeline copies. Then each parameter's ``.grad``
holds its gradient (for torch optimizers, see distributed_data_parallel.py). With
``DistributedDataParallelConfig(check_for_nan_in_grad=True)`` a gradient that is not finite is an error (read on
the host: one synchronisation per step)."""
from __future__ import annotations

from typing import Optional

import torch

from ...parallel.data import finalize_model_grads as _finalize
from ..parallel_state import current_dims
from .distributed_data_parallel import DistributedDataParallel


def finalize_model_grads(model: list, num_tokens: Optional[torch.Tensor] = None, pg_collection=None) -> None:
    """``model``: this rank's DistributedDataParallel chunks (Megatron's list)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    _finalize(chunks, current_dims(), num_tokens)
    for chunk in chunks:
        if isinstance(chunk, DistributedDataParallel):
            if chunk.ddp_config.check_for_nan_in_grad and not _finite(chunk):
                raise RuntimeError(f"rank {current_dims().rank}: a gradient is NaN or infinite after the data-parallel "
                                   "reduction (DistributedDataParallelConfig(check_for_nan_in_grad=True))")
            chunk.publish_grads()


def _finite(chunk) -> bool:
    """Whether every gradient this rank holds (its whole buffers, or its shards under ZeRO-2/3) is finite."""
    held = [t for buf in chunk.grad_buffers for t in (buf.grad_data, buf.grad_shard_data) if t is not None]
    return bool(torch.stack([torch.isfinite(t).all() for t in held]).all()) if held else True

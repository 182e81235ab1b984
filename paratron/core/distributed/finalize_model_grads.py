"""Megatron Core's ``finalize_model_grads(model)``: paratron's (paratron/parallel/data.py) for the
ParallelDims of ``parallel_state``: the data-parallel reduction, the sums over tensor parallelism of
sequence-parallel replicated parameters and of tied pipeline copies. Then each parameter's ``.grad``
holds its gradient (for torch optimizers, see distributed_data_parallel.py)."""
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
            chunk.publish_grads()

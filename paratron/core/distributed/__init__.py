"""Megatron Core's ``distributed``: DistributedDataParallel(config, ddp_config, module) over paratron's
DataParallel, its config, and ``finalize_model_grads``."""
from .distributed_data_parallel import DistributedDataParallel, DistributedDataParallelConfig
from .finalize_model_grads import finalize_model_grads

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads"]

"""Megatron Core's DistributedDataParallel: paratron's DataParallel (gradient buffers and buckets,
paratron/parallel/data.py) on the ParallelDims of ``parallel_state``.

One addition for loops written against torch optimizers (Megatron's tutorial steps ``torch.optim.Adam``):
after ``finalize_model_grads`` every parameter's ``.grad`` is its reduced gradient (a view of
``main_grad``), and the next forward starts a fresh step of the buffer (``zero_grad_buffer()``, which
Megatron's loops call themselves; calling it is still right). paratron's and the facade's optimizers
read ``main_grad`` directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...config import ConfigError
from ...config.check_moe import check_combined_overlap
from ...config.values import SHARDING_STRATEGIES, bucket_end_multiple
from ...parallel.data import DataParallel, split_size
from ..parallel_state import current_dims


@dataclass
class DistributedDataParallelConfig:
    """Megatron's fields. Scheduling choices with the same numbers are taken and make no difference
    (align_param_gather, average_in_collective, gradient_reduce_div_fusion, suggested_communication_unit_size); the
    others paratron has no counterpart for are accepted only at their defaults."""
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: Optional[int] = None
    num_buckets: Optional[int] = None  # instead of bucket_size: the module's parameters / N per bucket
    pad_buckets_for_high_nccl_busbw: bool = False  # each bucket's size a multiple of 2^16 elements too
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    use_megatron_fsdp: bool = False  # with data_parallel_sharding_strategy: ZeRO-1/2/3 on paratron's buffers
    use_custom_fsdp: bool = False  # Megatron Core's earlier name of use_megatron_fsdp
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False

    def __post_init__(self):
        for name in ("fp8_param_gather", "nccl_ub", "fsdp_double_buffer", "check_for_large_grads",
                     "keep_fp8_transpose_cache"):
            if getattr(self, name):
                raise ConfigError(f"DistributedDataParallelConfig({name}=True) is not supported by paratron.core")
        if not self.preserve_fp32_weights:
            raise ConfigError("DistributedDataParallelConfig(preserve_fp32_weights=False) is not supported by "
                              "paratron.core: its optimizers keep fp32 master weights")
        if self.data_parallel_sharding_strategy not in SHARDING_STRATEGIES:
            raise ConfigError(f"DistributedDataParallelConfig(data_parallel_sharding_strategy="
                              f"{self.data_parallel_sharding_strategy!r}): one of {', '.join(SHARDING_STRATEGIES)}")
        if self.data_parallel_sharding_strategy != "no_shard" and not self.fsdp:
            raise ConfigError("DistributedDataParallelConfig(data_parallel_sharding_strategy="
                              f"{self.data_parallel_sharding_strategy!r}) takes effect with use_megatron_fsdp=True, "
                              "as in Megatron Core: set it, or use_distributed_optimizer=True alone for ZeRO-1")
        if self.num_buckets is not None and (self.bucket_size is not None or self.num_buckets < 1):
            raise ConfigError("DistributedDataParallelConfig(num_buckets=...): a count >= 1, without bucket_size "
                              "(as in Megatron Core)")
        if self.num_distributed_optimizer_instances != 1:
            raise ConfigError("DistributedDataParallelConfig(num_distributed_optimizer_instances > 1) is not "
                              "supported by paratron.core")


    @property
    def fsdp(self) -> bool:
        return self.use_megatron_fsdp or self.use_custom_fsdp

    @property
    def sharding(self) -> int:
        """What is sharded over data parallelism (config/values.sharding_level): the strategy's ZeRO stage under
        Megatron-FSDP, else 1 with the distributed optimizer (ZeRO-1), else 0."""
        if self.fsdp:
            return SHARDING_STRATEGIES.index(self.data_parallel_sharding_strategy)
        return int(self.use_distributed_optimizer)


class DistributedDataParallel(DataParallel):
    """Megatron's constructor; ``module`` is the facade's (or paratron's) GPTModel, ``config`` its config."""

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 disable_bucketing: bool = False, **_megatron_only):
        model_cfg = getattr(module, "config", None)
        if getattr(model_cfg, "overlap_moe_expert_parallel_comm", False):  # its rule on the sharding (config/check_moe)
            check_combined_overlap(model_cfg, expert_ranks=None, recompute_granularity=None,
                                   sharding_strategy=SHARDING_STRATEGIES[ddp_config.sharding])
        low = next(module.parameters()).dtype
        grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 or low == torch.float32 else low
        buckets = ddp_config.num_buckets
        size = ddp_config.bucket_size if buckets is None else split_size([module], buckets)
        super().__init__(module, current_dims(), grad_dtype=grad_dtype, bucket_size=None if disable_bucketing else size,
                         bucket_end_multiple=bucket_end_multiple(ddp_config.pad_buckets_for_high_nccl_busbw),
                         overlap_grad_reduce=ddp_config.overlap_grad_reduce,
                         use_distributed_optimizer=ddp_config.use_distributed_optimizer,
                         overlap_param_gather=ddp_config.overlap_param_gather, sharding=ddp_config.sharding)
        self.config, self.ddp_config = config, ddp_config
        self.grads_published = False  # finalize_model_grads set .grad; the next forward starts a step

    def publish_grads(self) -> None:
        """Each parameter's ``.grad`` = its reduced gradient (for torch optimizers), until the next step. Not
        under ZeRO-2/3 (sharded gradients: each rank holds only its shard; get_megatron_optimizer steps them)."""
        if self.sharding >= 2:
            return
        for p in self.params:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        self.grads_published = True

    def zero_grad_buffer(self) -> None:
        """Start a step: the buffers take the next gradients afresh (and ``.grad`` is dropped)."""
        if getattr(self, "grads_published", False):
            for p in self.params:
                p.grad = None
            self.grads_published = False
        super().zero_grad_buffer()

    def forward(self, *args, **kwargs):
        if self.grads_published:
            self.zero_grad_buffer()
        return super().forward(*args, **kwargs)

    def broadcast_params(self) -> None:
        """Megatron copies data-parallel rank 0's parameters to the others; paratron's ranks build
        identical parameters from the seed, so there is nothing to copy."""

"""Megatron Core's ``optimizer``: ``OptimizerConfig`` and ``get_megatron_optimizer(config, model_chunks)``
for a model built by hand: paratron's AdamW with fp32 master weights, fp16 loss scaling and clipping by
the global norm (paratron/optim/optimizer.py), or its distributed form with ``use_distributed_optimizer``.

The result has Megatron's optimizer methods: ``step()`` -> (update applied, grad norm, None),
``zero_grad()`` (a fresh gradient buffer for the next step), ``param_groups``, ``get_loss_scale()``.
The chunks must be wrapped in ``paratron.core.distributed.DistributedDataParallel``; the learning rate is
the config's (set another with ``set_lr``: paratron's schedules are paratron.optim.schedule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...config import ConfigError, OptimConfig, TrainConfig
from ...config.check_optim import validate_precision_aware
from ...optim.optimizer import build_optimizer, hand_built_config
from ...parallel.stages import unwrap
from ..parallel_state import current_dims


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}


@dataclass
class OptimizerConfig:
    """Megatron's fields that paratron implements (others are a TypeError, as for any dataclass)."""
    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    use_distributed_optimizer: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: object = None
    config_logger_dir: str = ""
    apply_wd_to_qk_layernorm: bool = False
    # the precision-aware optimizer (paratron/optim/moments.py); torch.uint8 is fp8, as in Megatron
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.optimizer != "adam":
            raise ConfigError(f"OptimizerConfig(optimizer={self.optimizer!r}): paratron.core has adam (Muon is "
                              "paratron's --optimizer muon)")
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ConfigError(f"OptimizerConfig({name}={getattr(self, name)}): choose one of torch.float32, "
                                  "torch.bfloat16, torch.float16, torch.uint8 (fp8)")

    def paratron(self, model_config) -> "object":
        """paratron's Config for build_optimizer (paratron.optim.optimizer.hand_built_config)."""
        optim = OptimConfig(lr=self.lr, min_lr=self.min_lr or 0.0, decoupled_lr=self.decoupled_lr,
                            decoupled_min_lr=self.decoupled_min_lr, weight_decay=self.weight_decay,
                            adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2, adam_eps=self.adam_eps,
                            clip_grad=self.clip_grad, apply_wd_to_qk_layernorm=self.apply_wd_to_qk_layernorm,
                            use_precision_aware_optimizer=self.use_precision_aware_optimizer,
                            **{name: DTYPE_NAMES[getattr(self, name)] for name in ("main_grads_dtype",
                               "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")})
        train = TrainConfig(fp16=self.fp16, bf16=self.bf16, loss_scale=self.loss_scale,
                            initial_loss_scale=self.initial_loss_scale, min_loss_scale=self.min_loss_scale,
                            loss_scale_window=int(self.loss_scale_window), hysteresis=self.hysteresis)
        cfg = hand_built_config(model_config, optim, train, self.use_distributed_optimizer)
        validate_precision_aware(cfg)  # (the gradient buffers are the DDP wrapper's: checked against it)
        return cfg


class MegatronOptimizer:
    """paratron's optimizer (``.optimizer``) with Megatron's method names."""

    def __init__(self, optimizer, model_chunks: list):
        self.optimizer, self.model_chunks = optimizer, model_chunks

    @property
    def param_groups(self) -> list:
        return self.optimizer.adam.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(self.optimizer.loss_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()

    def step(self):
        applied, norm = self.optimizer.step()
        return bool(applied), float(norm), None

    def set_lr(self, lr: float) -> None:
        self.optimizer.set_lr(lr)

    def reload_model_params(self) -> None:
        self.optimizer.reload_masters()


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list, no_weight_decay_cond=None,
                           scale_lr_cond=None, lr_mult: float = 1.0, **_megatron_only) -> MegatronOptimizer:
    """Megatron's signature; the parameter groups follow Megatron's default rules (no weight decay on
    biases and norms), as paratron.optim.groups: custom conditions are refused."""
    if no_weight_decay_cond is not None or scale_lr_cond is not None or lr_mult != 1.0:
        raise ConfigError("get_megatron_optimizer(no_weight_decay_cond / scale_lr_cond / lr_mult) is not supported "
                          "by paratron.core: the parameter groups are Megatron's defaults")
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not all(hasattr(c, "grad_buffers") for c in chunks):
        raise ConfigError("get_megatron_optimizer needs the model chunks wrapped in "
                          "paratron.core.distributed.DistributedDataParallel")
    sharded = max(c.sharding for c in chunks)
    if sharded and not config.use_distributed_optimizer:
        raise ConfigError("the model chunks shard the optimizer state over data parallelism (DistributedDataParallel"
                          "Config's sharding strategy or distributed optimizer): OptimizerConfig(use_distributed_"
                          "optimizer=True)")
    cfg = config.paratron(unwrap(chunks[0]).config)
    buffers = {(b.grad_data if b.grad_data is not None else b.grad_shard_data).dtype
               for c in chunks for b in c.grad_buffers}
    if config.main_grads_dtype == torch.bfloat16 and buffers != {torch.bfloat16}:
        raise ConfigError("OptimizerConfig(main_grads_dtype=torch.bfloat16) needs bf16 gradient buffers: wrap the "
                          "chunks with DistributedDataParallelConfig(grad_reduce_in_fp32=False) and a bf16 model")
    return MegatronOptimizer(build_optimizer(chunks, cfg, current_dims()), chunks)


__all__ = ["OptimizerConfig", "get_megatron_optimizer", "MegatronOptimizer"]

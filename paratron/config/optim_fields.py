"""The precision-aware optimizer's fields of the optim section (``OptimConfig`` inherits them:
--exp-avg-dtype is ``cfg.optim.exp_avg_dtype``; checked in config/check_optim.py, implemented in
paratron/optim/moments.py), and Megatron-FSDP's dtype flags, which name the same buffers. Megatron's names,
choices and defaults."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=True)
class PrecisionAwareFields:
    use_precision_aware_optimizer: bool = False  # Adam moments / main gradients in the dtypes of the flags below
    main_grads_dtype: str = "fp32"  # fp32 | bf16 (the bf16 gradient buffer and reduction: --grad-reduce-in-bf16)
    main_params_dtype: str = "fp32"  # the master weights: fp32 (fp16 masters are refused)
    exp_avg_dtype: str = "fp32"  # Adam's first moment in memory: fp32 | bf16 | fp16 | fp8 (fp16 / fp8 scaled)
    exp_avg_sq_dtype: str = "fp32"  # Adam's second moment in memory: fp32 | bf16 | fp16 | fp8 (computed in fp32)
    # Megatron-FSDP's names of the master-weight / main-gradient dtypes (with --use-megatron-fsdp; auto: see
    # config/check_optim.validate_fsdp_dtypes)
    megatron_fsdp_main_params_dtype: str = "fp32"  # fp32 | auto (the model's dtype: fp32 models only)
    megatron_fsdp_main_grads_dtype: str = "auto"  # auto (paratron's fp32) | fp32 | bf16 (--grad-reduce-in-bf16)
    megatron_fsdp_grad_comm_dtype: str = "auto"  # auto (the main gradients') | the main gradients' dtype

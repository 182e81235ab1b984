"""Validation of Megatron's norm/activation/attention variants, the decoupled learning rate and the
Muon optimizer (called from ``resolve()``; one-line errors)."""
from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError
from .sections import Config, ModelConfig, OptimConfig, flag

OPTIMIZERS = ("adam", "muon", "dist_muon")
REFUSED_OPTIMIZERS = ("sgd", "lion", "soap", "adaptive_muon")
MUON_CHOICES = {
    "muon_scale_mode": ("spectral", "unit_rms_norm", "shape_scaling"),
    "muon_fp32_matmul_prec": ("medium", "high", "highest"),
    "muon_coefficient_type": ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4", "cubic5"),
    "muon_tp_mode": ("duplicated", "distributed", "blockwise"),
    "muon_scalar_optimizer": ("adam",),
}


def need(cond, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate_variants(m: ModelConfig) -> None:
    """--squared-relu / --quick-geglu / --swiglu, the GLU offset and clamp, as Megatron checks them."""
    acts = [name for name in ("swiglu", "squared_relu", "quick_geglu") if getattr(m, name)]
    if len(acts) > 1:
        raise ConfigError(f"{flag(acts[0])} and {flag(acts[1])} exclude each other; choose one activation")
    gated = m.swiglu or m.quick_geglu
    if m.glu_linear_offset != 0.0:
        need(gated, "--glu-linear-offset needs a gated MLP (--quick-geglu or --swiglu)")
        need(not m.swiglu or m.no_bias_swiglu_fusion, "--glu-linear-offset with --swiglu: Megatron's fused SwiGLU "
             "has no offset; use --quick-geglu or add --no-bias-swiglu-fusion")
    clamp = m.activation_func_clamp_value
    if clamp is not None:
        need(gated, "--activation-func-clamp-value needs a gated MLP (--quick-geglu or --swiglu)")
        need(math.isfinite(clamp) and clamp > 0, f"--activation-func-clamp-value must be finite and > 0 (got {clamp})")
        if m.swiglu:
            need(m.num_experts is not None, "--activation-func-clamp-value with --swiglu needs --num-experts "
                 "(Megatron clamps SwiGLU only in MoE models)")
            need(m.glu_linear_offset == 0.0, "--activation-func-clamp-value with --swiglu needs --glu-linear-offset 0")


def validate_lr_groups(op: OptimConfig) -> None:
    """--decoupled-lr / --decoupled-min-lr."""
    if op.decoupled_lr is None:
        need(op.decoupled_min_lr is None, "--decoupled-min-lr needs --decoupled-lr (it is the minimum of that LR)")
        return
    low = op.min_lr if op.decoupled_min_lr is None else op.decoupled_min_lr
    need(op.decoupled_lr >= low >= 0.0, f"--decoupled-lr {op.decoupled_lr} must be >= its minimum LR {low} >= 0 "
         "(--decoupled-min-lr, default --min-lr)")


def validate_optimizer(cfg: Config) -> None:
    """--optimizer and the Muon flags; ``--optimizer dist_muon`` becomes muon with the distributed optimizer
    (Megatron's deprecated spelling of --optimizer muon --use-distributed-optimizer)."""
    op = cfg.optim
    need(op.optimizer not in REFUSED_OPTIMIZERS, f"--optimizer {op.optimizer} is not in paratron yet; use adam or "
         "muon")
    need(op.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {op.optimizer})")
    validate_lr_groups(op)
    defaults = {f.name: f.default for f in dataclasses.fields(op) if f.name.startswith("muon_")}
    if op.optimizer == "adam":
        given = [n for n, d in defaults.items() if getattr(op, n) != d]
        need(not given, f"{flag(given[0]) if given else ''} has no effect without --optimizer muon; remove the flag")
        return
    if op.optimizer == "dist_muon":
        op.optimizer = "muon"
        cfg.parallel.use_distributed_optimizer = True
    need(not cfg.train.fp16, "--optimizer muon with --fp16 is not supported (as in Megatron); use --bf16")
    for name, choices in MUON_CHOICES.items():
        need(getattr(op, name) in choices, f"{flag(name)} {getattr(op, name)}: choose one of {', '.join(choices)}")
    need(op.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1 (got {op.muon_num_ns_steps})")
    need(op.muon_coefficient_type != "cubic5" or op.muon_num_ns_steps == 5,
         "--muon-coefficient-type cubic5 is a fixed 5-step schedule: use --muon-num-ns-steps 5")
    need(0.0 <= op.muon_momentum < 1.0, f"--muon-momentum must be in [0, 1) (got {op.muon_momentum})")


def validate_run_variants(cfg: Config) -> None:
    """Checks that need two sections: the bf16 matmul switch, --log-progress's file."""
    need(not cfg.train.disable_bf16_reduced_precision_matmul or cfg.train.bf16,
         "--disable-bf16-reduced-precision-matmul needs --bf16 (it changes bf16 matmuls only)")
    need(not cfg.log.log_progress or cfg.ckpt.save, "--log-progress writes <save>/progress.txt: add --save DIR")

"""Checks of the optimizer section: the learning-rate schedule, the decoupled learning rate, --optimizer
and the Muon flags."""
from __future__ import annotations

import dataclasses

from .rules import need
from .sections import Config, OptimConfig, flag
from .values import MAIN_GRADS_DTYPES, MOMENT_DTYPES

OPTIMIZERS = ("adam", "muon", "dist_muon")
REFUSED_OPTIMIZERS = ("sgd", "lion", "soap", "adaptive_muon")
MUON_CHOICES = {
    "muon_scale_mode": ("spectral", "unit_rms_norm", "shape_scaling"),
    "muon_fp32_matmul_prec": ("medium", "high", "highest"),
    "muon_coefficient_type": ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4", "cubic5"),
    "muon_tp_mode": ("duplicated", "distributed", "blockwise"),
    "muon_scalar_optimizer": ("adam",),
}


def validate_optim(op) -> None:
    need(op.lr is not None, "set the learning rate with --lr (e.g. --lr 3e-4)")
    need(op.lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
         f"--lr-decay-style must be one of constant, linear, cosine, inverse-square-root, WSD "
         f"(got {op.lr_decay_style})")
    need(op.lr_wsd_decay_style in ("linear", "cosine", "exponential", "minus_sqrt"),
         "--lr-wsd-decay-style must be linear, cosine, exponential or minus_sqrt")
    if op.lr_warmup_fraction is not None:
        need(op.lr_warmup_iters == 0, "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
    need(op.min_lr <= op.lr, f"--min-lr {op.min_lr} is larger than --lr {op.lr}")
    need(not (op.override_opt_param_scheduler and op.use_checkpoint_opt_param_scheduler),
         "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive; choose one")
    validate_offload(op)


def validate_lr_groups(op: OptimConfig) -> None:
    """--decoupled-lr / --decoupled-min-lr."""
    if op.decoupled_lr is None:
        need(op.decoupled_min_lr is None, "--decoupled-min-lr needs --decoupled-lr (it is the minimum of that LR)")
        return
    low = op.min_lr if op.decoupled_min_lr is None else op.decoupled_min_lr
    need(op.decoupled_lr >= low >= 0.0, f"--decoupled-lr {op.decoupled_lr} must be >= its minimum LR {low} >= 0 "
         "(--decoupled-min-lr, default --min-lr)")


def validate_offload(op) -> None:
    """--optimizer-cpu-offload and --optimizer-offload-fraction (paratron/optim/offload.py)."""
    f = op.optimizer_offload_fraction
    need(0.0 <= f <= 1.0, f"--optimizer-offload-fraction must be in [0, 1] (got {f})")
    if op.optimizer_cpu_offload:
        need(op.optimizer == "adam", f"--optimizer-cpu-offload with --optimizer {op.optimizer} is not implemented "
             "(the host update is AdamW's); use --optimizer adam or remove the offload")


def validate_optimizer(cfg: Config) -> None:
    """--optimizer and the Muon flags; ``--optimizer dist_muon`` becomes muon with the distributed optimizer
    (Megatron's deprecated spelling of --optimizer muon --use-distributed-optimizer)."""
    op = cfg.optim
    validate_precision_aware(cfg)
    validate_fsdp_dtypes(cfg)
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
    par = cfg.parallel
    need(not (par.use_megatron_fsdp and par.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")),
         f"--optimizer muon with --data-parallel-sharding-strategy {par.data_parallel_sharding_strategy} is not "
         "implemented (Muon gathers whole gradient buckets); use strategy optim or --optimizer adam")
    for name, choices in MUON_CHOICES.items():
        need(getattr(op, name) in choices, f"{flag(name)} {getattr(op, name)}: choose one of {', '.join(choices)}")
    need(op.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1 (got {op.muon_num_ns_steps})")
    need(op.muon_coefficient_type != "cubic5" or op.muon_num_ns_steps == 5,
         "--muon-coefficient-type cubic5 is a fixed 5-step schedule: use --muon-num-ns-steps 5")
    need(0.0 <= op.muon_momentum < 1.0, f"--muon-momentum must be in [0, 1) (got {op.muon_momentum})")


def validate_precision_aware(cfg: Config) -> None:
    """--use-precision-aware-optimizer and its dtypes (Megatron's rules: the dtypes other than fp32 need the flag,
    the flag needs --optimizer adam). ``--main-grads-dtype bf16`` is the bf16 gradient buffer and reduction:
    it sets --grad-reduce-in-bf16."""
    op, tr, par = cfg.optim, cfg.train, cfg.parallel
    choices = {"main_grads_dtype": MAIN_GRADS_DTYPES, "main_params_dtype": ("fp32", "fp16"),
               "exp_avg_dtype": MOMENT_DTYPES, "exp_avg_sq_dtype": MOMENT_DTYPES}
    for name, values in choices.items():
        value = getattr(op, name)
        need(value in values, f"{flag(name)} {value}: choose one of {', '.join(values)}")
        need(value == "fp32" or op.use_precision_aware_optimizer,
             f"{flag(name)} {value} needs --use-precision-aware-optimizer (as in Megatron); add it or use fp32")
    if not op.use_precision_aware_optimizer:
        return
    need(op.optimizer == "adam", f"--use-precision-aware-optimizer works with --optimizer adam only (as in Megatron), "
         f"not {op.optimizer}; remove the flag or use adam")
    need(op.main_params_dtype == "fp32", "--main-params-dtype fp16 (master weights in fp16, scaled per tensor) is not "
         "implemented: paratron keeps the master weights in fp32; use --main-params-dtype fp32")
    if op.main_grads_dtype == "bf16":
        bf16_main_grads("--main-grads-dtype", tr, par)


def bf16_main_grads(name: str, tr, par) -> None:
    """``name`` bf16 (--main-grads-dtype, --megatron-fsdp-main-grads-dtype): the bf16 gradient buffer and reduction
    (--grad-reduce-in-bf16), under Megatron's rules."""
    need(tr.bf16, f"{name} bf16 needs --bf16 (the model's gradients are bf16); use fp32 or add --bf16")
    need(not par.accumulate_allreduce_grads_in_fp32, f"{name} bf16 contradicts --accumulate-allreduce-grads-in-fp32 "
         "(as in Megatron); remove one")
    par.grad_reduce_in_bf16 = True


FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")


def validate_fsdp_dtypes(cfg: Config) -> None:
    """Megatron-FSDP's --megatron-fsdp-main-params-dtype / -main-grads-dtype / -grad-comm-dtype onto paratron's
    buffers: fp32 master weights (auto: the model's dtype, so fp32 models only); main gradients fp32 (auto: paratron
    keeps fp32, where Megatron-FSDP's auto takes the model's dtype) or bf16, the bf16 gradient buffer and reduction
    (--grad-reduce-in-bf16); gradients communicated in the main gradients' dtype (auto)."""
    op, tr, par = cfg.optim, cfg.train, cfg.parallel
    given = {name: getattr(op, name) for name in ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype",
                                                   "megatron_fsdp_grad_comm_dtype")}
    for name, value in given.items():
        need(value in FSDP_DTYPES, f"{flag(name)} {value}: choose one of {', '.join(FSDP_DTYPES)}")
    params, grads, comm = given.values()
    if (params, grads, comm) == ("fp32", "auto", "auto"):
        return
    need(par.use_megatron_fsdp, "the --megatron-fsdp-*-dtype flags set Megatron-FSDP's buffers: add "
         "--use-megatron-fsdp or remove them")
    model_dtype = "bf16" if tr.bf16 else "fp16" if tr.fp16 else "fp32"
    need(params == "fp32" or (params == "auto" and model_dtype == "fp32"),
         f"--megatron-fsdp-main-params-dtype {params} (master weights in {model_dtype if params == 'auto' else params})"
         " is not implemented: paratron keeps the master weights in fp32; use fp32")
    need(grads in ("auto", "fp32", "bf16"), f"--megatron-fsdp-main-grads-dtype {grads} is not implemented "
         "(paratron's main gradients are fp32 or bf16); use fp32 or bf16")
    main = "fp32" if grads == "auto" else grads
    need(comm in ("auto", main), f"--megatron-fsdp-grad-comm-dtype {comm} with {main} main gradients: paratron "
         f"reduces gradients in the main gradients' dtype; use auto or {main}")
    if main == "bf16":
        bf16_main_grads("--megatron-fsdp-main-grads-dtype", tr, par)

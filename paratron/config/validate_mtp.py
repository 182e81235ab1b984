"""Checks of the multi-token prediction flags (paratron/model/mtp.py), called from validate.py."""
from __future__ import annotations

from .sections import Config, ModelConfig
from .validate import need

DEFAULT_SCALING = ModelConfig.__dataclass_fields__["mtp_loss_scaling_factor"].default


def validate_mtp(cfg: Config) -> None:
    """--mtp-num-layers and --mtp-loss-scaling-factor, and the parallel layouts MTP runs under."""
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers is None:
        need(m.mtp_loss_scaling_factor == DEFAULT_SCALING, "--mtp-loss-scaling-factor has no effect without "
             "--mtp-num-layers; set --mtp-num-layers or remove the flag")
        for name in ("mtp_use_repeated_layer", "mtp_detach_heads"):
            need(not getattr(m, name), f"--{name.replace('_', '-')} has no effect without --mtp-num-layers; set "
                 "--mtp-num-layers or remove the flag")
        return
    need(p.pipeline_model_parallel_size == 1, "--mtp-num-layers with --pipeline-model-parallel-size "
         f"{p.pipeline_model_parallel_size}: multi-token prediction runs without pipeline parallelism only in "
         "paratron; use --pipeline-model-parallel-size 1")

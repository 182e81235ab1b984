"""The FP8 fields of the train section (``TrainConfig`` inherits them: --fp8-format is ``cfg.train.fp8_format``;
checked in config/check_train.py, the per-module precision file read by config/precision_file.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=True)
class FP8Fields:
    fp8_format: Optional[str] = None  # FP8 matmuls (paratron/fp8/): e4m3 | hybrid (e5m2 gradients); Hopper/Ada, CPU
    fp8_recipe: str = "delayed"  # tensorwise (current amax) | delayed (amax history) | blockwise (1x128, 128x128 tiles)
    fp8_amax_history_len: int = 1  # delayed: amaxes kept per tensor
    fp8_amax_compute_algo: str = "most_recent"  # delayed: max | most_recent of the history
    fp8_margin: int = 0  # scale = fp8 max / (amax * 2^margin)
    fp8_hybrid: bool = False  # Megatron's older spelling of --fp8-format hybrid
    no_fp8_wgrad: bool = False  # FP8: weight gradients in bf16 from the bf16 input and output gradient
    first_last_layers_bf16: bool = False  # FP8: the first and last decoder layers stay in bf16
    num_layers_at_start_in_bf16: int = 1  # with --first-last-layers-bf16: how many first layers
    num_layers_at_end_in_bf16: int = 1  # with --first-last-layers-bf16: how many last layers
    disable_parameter_transpose_cache: bool = False  # FP8: cast weights at every micro-batch, not once per step
    te_precision_config_file: Optional[str] = None  # FP8: YAML of per-module precision (Megatron's format), by name

"""The log section's fields that watch the GPUs and ranks rather than the model (``LogConfig`` inherits them):
--log-straggler (paratron/train/watch.py) and --log-energy (paratron/train/energy.py). Megatron's names and
defaults; checked in config/check_train.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=True)
class MonitorFields:
    log_straggler: bool = False  # every log interval: the slowest and fastest ranks (forward-backward time, TFLOP/s)
    straggler_minmax_count: int = 1  # with --log-straggler: also list this many lowest and highest ranks
    disable_straggler_on_startup: bool = False  # --log-straggler starts off; the control port turns it on
    straggler_ctrlr_port: int = 65535  # --log-straggler's on/off switch: a connection to this port on rank 0
    log_energy: bool = False  # the log line's energy (J per iteration) and power (W) per GPU, from NVML's counter

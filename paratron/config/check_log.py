"""Checks of the logging section: timing levels, wandb, the sample prompt, the profiled ranks."""
from __future__ import annotations

import importlib.util

from .rules import need, whole_numbers


def validate_log(lg) -> None:
    need(lg.timing_log_level in (0, 1, 2), f"--timing-log-level must be 0, 1 or 2 (got {lg.timing_log_level})")
    need(lg.timing_log_option in ("max", "minmax", "all"),
         f"--timing-log-option must be max, minmax or all (got {lg.timing_log_option})")
    if lg.wandb_project is not None:
        need(importlib.util.find_spec("wandb") is not None,
             "--wandb-project needs the wandb package: pip install 'paratron[wandb]' (or pip install wandb)")
    need(lg.sample_prompt != "", "--sample-prompt: the prompt is empty; give some text")
    if lg.profile_ranks is not None:
        lg.profile_ranks = whole_numbers(lg.profile_ranks, "--profile-ranks")

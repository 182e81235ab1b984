"""The data section's fields that name files of data paths (``DataConfig`` inherits them), Megatron's flags for
blends too long for a command line; config/check_data.read_data_path_files reads them into --data-path and
--train/valid/test-data-path before the data flags are checked."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=True)
class DataFileFields:
    data_args_path: Optional[str] = None  # a text file of --data-path's values ([WEIGHT] PREFIX ...), read at start
    per_split_data_args_path: Optional[str] = None  # JSON {"train": ..., "valid": ..., "test": ...}: per-split blends

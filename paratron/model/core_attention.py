"""Sliding windows and attention sinks: moved to ``paratron/model/attention/windowed.py``; the names stay
importable from here (config validation, tests, benchmarks)."""
from .attention.windowed import (SOFTMAX_TYPES, CoreAttention, WindowedAttention, layer_pattern,  # noqa: F401
                                 needs_core_attention, parse_window_size, rope_layers, window_layers)

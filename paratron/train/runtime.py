"""Process-wide switches of a run: --deterministic-mode, --manual-gc (+ interval, eval),
--empty-unused-memory-level."""
from __future__ import annotations

import gc
import os
from typing import Optional

import torch


def apply_deterministic_mode(enabled: bool) -> None:
    """--deterministic-mode: deterministic kernels only (an op without one is an error, as Megatron),
    Megatron's environment defaults (cuBLAS's fixed workspace, NCCL's ring algorithm, read when the
    first communicator is made), no cuDNN autotuning."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def apply_bf16_matmul_reduction(cfg) -> None:
    """--disable-bf16-reduced-precision-matmul (with --bf16): bf16 matmuls accumulate in fp32 all the way
    (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False), as Megatron sets it.
    A process-wide torch setting; it changes cuBLAS's choice of kernels, on GPU only."""
    if cfg.train.bf16 and cfg.train.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


class GarbageCollection:
    """--manual-gc: Python's automatic collector off for the run; a full collection every
    --manual-gc-interval steps (0: none), around evaluations (unless --no-manual-gc-eval), and at
    the end (which turns the collector back on)."""

    def __init__(self, train_cfg):
        self.on, self.interval = train_cfg.manual_gc, train_cfg.manual_gc_interval
        self.eval = not train_cfg.no_manual_gc_eval
        self.collections = 0
        if self.on:
            gc.disable()
            self._collect()

    def _collect(self) -> None:
        gc.collect()
        self.collections += 1

    def after_step(self, iteration: int) -> None:
        if self.on and self.interval and iteration % self.interval == 0:
            self._collect()

    def around_eval(self) -> None:
        if self.on and self.eval:
            self._collect()

    def close(self) -> None:
        if self.on:
            self._collect()
            gc.enable()
            self.on = False


def empty_unused_memory(level: int, at: int, device: torch.device) -> None:
    """--empty-unused-memory-level: return cached CUDA memory after each step (``at`` 1) and also
    after evaluation (``at`` 2) when the level reaches ``at``."""
    if device.type == "cuda" and level >= at:
        torch.cuda.empty_cache()


def apply_logging_level(level) -> Optional[int]:
    """--logging-level: the level of Python's root logger for the run (Megatron's meaning). Returns the
    level it replaced (the trainer puts it back when it closes), None when the flag is not given."""
    if level is None:
        return None
    import logging
    root = logging.getLogger()
    previous = root.level
    logging.basicConfig(level=level)
    root.setLevel(level)
    return previous

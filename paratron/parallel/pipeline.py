"""Schedules behind ``get_forward_backward_func()``, with Megatron's calling convention:

    forward_step_func(data_iterator, model) -> (output, loss_func)
    loss_func(output) -> (loss_sum, num_tokens, {"lm loss": tensor([sum, n])})

Each micro-batch's loss is divided by its token count and by the number of micro-batches (Megatron's
default, ``calculate_per_token_loss=False``). The schedule returns the list of report dicts of the
micro-batches (on the last pipeline stage).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from .dims import ParallelDims


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator, model,
                                   num_microbatches: int, seq_length: int = 0, micro_batch_size: int = 0,
                                   forward_only: bool = False, grad_scale: float = 1.0,
                                   **_unused) -> list[dict]:
    """Gradient accumulation over micro-batches on one pipeline stage."""
    if isinstance(model, (list, tuple)):
        (model,) = model
    reports = []
    no_sync = getattr(model, "no_sync", None)  # DataParallel: no gradient reduction before the last micro-batch
    for i in range(num_microbatches):
        defer = no_sync is not None and not forward_only and i < num_microbatches - 1
        with no_sync() if defer else contextlib.nullcontext():
            with torch.set_grad_enabled(not forward_only):
                output, loss_func = forward_step_func(data_iterator, model)
                loss_sum, num_tokens, report = loss_func(output)
                loss = loss_sum / num_tokens.clamp(min=1) / num_microbatches
            if not forward_only:
                (loss * grad_scale).backward()
        reports.append(report)
    return reports


def get_forward_backward_func(dims: Optional[ParallelDims] = None) -> Callable:
    pp = dims.pp if dims is not None else 1
    if pp == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline-parallel schedules are not available yet (issue: pipeline parallelism)")

"""Megatron Core's ``get_forward_backward_func()``: paratron's schedule for the ParallelDims of
``parallel_state`` (no pipelining, 1F1B or interleaved: paratron/parallel/pipeline.py), called with
Megatron's keyword arguments and Megatron's ``loss_func`` convention:

    loss_func(output) -> (loss, {"lm loss": loss})                      the micro-batch's mean loss
    loss_func(output) -> (loss_sum, num_tokens, {"lm loss": ...})       paratron's (and Megatron's newer) form

Each micro-batch backpropagates its loss / number of micro-batches (the two-value form) or its loss sum
/ its tokens / number of micro-batches (the three-value form). The call returns the micro-batches'
report dicts on the last pipeline stage (an empty list elsewhere).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from ...parallel.layout import BatchLayout
from ...parallel.pipeline import get_forward_backward_func as _schedule_of
from ...parallel.stages import unwrap
from ..parallel_state import current_dims

ONE = torch.ones(())


def _three_values(loss_func: Callable, output):
    """Megatron's two-value loss_func result as paratron's (loss sum, tokens, report)."""
    result = loss_func(output)
    if len(result) == 2:
        loss, report = result
        return loss, ONE.to(loss.device), report
    return result


def _layout(model, seq_length: int, micro_batch_size: int, dims) -> BatchLayout:
    """What travels between pipeline stages: [s (/TP with sequence parallelism), b, h] activations."""
    chunk = unwrap(model[0] if isinstance(model, (list, tuple)) else model)
    p = next(chunk.parameters())
    return BatchLayout(micro_batch_size=micro_batch_size, seq_length=seq_length, hidden_size=chunk.config.hidden_size,
                       dtype=p.dtype, device=p.device, tp=dims.tp, sequence_parallel=chunk.par.sequence_parallel)


def get_forward_backward_func(vp_stage=None, pp_size=None) -> Callable:
    """The schedule of this process's layout, with Megatron's keyword arguments."""
    dims = current_dims()
    schedules: dict = {}  # by the model config's overlap_moe_expert_parallel_comm (the turns: parallel/turns.py)

    def forward_backward_func(*, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
                              seq_length: int = 0, micro_batch_size: int = 0, decoder_seq_length=None,
                              forward_only: bool = False, collect_non_loss_data: bool = False, **_megatron_only):
        chunk = unwrap(model[0] if isinstance(model, (list, tuple)) else model)
        turns = bool(getattr(chunk.config, "overlap_moe_expert_parallel_comm", False))
        if turns not in schedules:
            schedules[turns] = _schedule_of(dims, overlap_moe_comm=turns)
        schedule = schedules[turns]

        def step(iterator, chunk):
            output, loss_func = forward_step_func(iterator, chunk)
            return output, partial(_three_values, loss_func)

        layout = _layout(model, seq_length, micro_batch_size, dims) if dims.pp > 1 else None
        return schedule(forward_step_func=step, data_iterator=data_iterator, model=model,
                        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        layout=layout, forward_only=forward_only)

    return forward_backward_func

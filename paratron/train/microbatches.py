"""The check of the batch-size schedule against the layout before training (the schedule itself,
:class:`MicroBatches`, is the config's: paratron/config/batch_schedule.py)."""
from __future__ import annotations

from ..config import ConfigError
from ..config.batch_schedule import MicroBatches
from ..parallel.pipeline import check_pipeline_schedule


def check_batch_sizes(micro: MicroBatches, consumed_samples: int, dims, micro_batch_size: int,
                      evaluates: bool = True) -> None:
    """Before training (after a resume): every global batch size still to come splits into micro-batches
    over the data-parallel ranks, in a number the pipeline schedule takes, and so does an evaluation
    step's (``evaluates``) (one-line ConfigErrors)."""
    for gbs in micro.batch_sizes_from(consumed_samples):
        if gbs % micro.per_micro_step:
            raise ConfigError(f"the global batch size {gbs} (of the batch-size schedule at {consumed_samples} consumed "
                              f"samples or later) is not divisible by --micro-batch-size {micro_batch_size} x "
                              f"data-parallel size {dims.dp}; change the schedule or the layout")
        check_pipeline_schedule(dims, gbs // micro.per_micro_step)
    if evaluates and micro.eval_global_batch_size is not None and micro.eval_global_batch_size % micro.per_micro_step:
        raise ConfigError(f"--eval-global-batch-size {micro.eval_global_batch_size} is not divisible by "
                          f"--micro-batch-size {micro_batch_size} x data-parallel size {dims.dp}")
    if evaluates and (micro.steps is not None or micro.eval_global_batch_size is not None):
        check_pipeline_schedule(dims, micro.eval_microbatches(consumed_samples))

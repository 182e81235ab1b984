"""How many micro-batches a step runs: constant, following ``--rampup-batch-size START INCREMENT
SAMPLES`` (Megatron's former RampupBatchsizeNumMicroBatchesCalculator), or following
``--step-batch-size-schedule "THRESHOLD:BS ..."`` (Megatron's StepBatchsizeNumMicroBatchesCalculator).

With a ramp the global batch starts at START and grows by INCREMENT each SAMPLES / num_increments
consumed samples until it reaches ``--global-batch-size``. With a step schedule the global batch is
the BS of the last entry whose THRESHOLD (in samples, see paratron/config/validate_sched.py) is at
most the samples consumed. Either way it depends only on the number of samples consumed before the
step, so a resumed run continues the schedule exactly. The data iterator needs no change: each
data-parallel rank simply draws more micro-batches per step, and the ranks together consume exactly
the current global batch.
"""
from __future__ import annotations

from typing import Optional, Sequence


class MicroBatches:
    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: Optional[list] = None, steps: Optional[Sequence[tuple[int, int]]] = None,
                 eval_global_batch_size: Optional[int] = None):
        """``steps``: the parsed step schedule, [(threshold in samples, global batch)] with thresholds
        increasing from 0 (paratron.config.validate_sched.step_schedule); ``eval_global_batch_size``:
        Megatron's --eval-global-batch-size."""
        self.global_batch_size, self.eval_global_batch_size = global_batch_size, eval_global_batch_size
        self.per_micro_step = micro_batch_size * data_parallel_size  # samples per micro-batch, all ranks
        self.ramp = None
        self.steps = [(int(t), int(b)) for t, b in steps] if steps else None
        if rampup_batch_size is not None:
            start, inc, samples = (int(v) for v in rampup_batch_size)
            increments = (global_batch_size - start) // inc
            self.ramp = (start, inc, samples, samples / increments if increments else 0.0)

    def global_batch(self, consumed_samples: int) -> int:
        """The global batch size of the step that starts after ``consumed_samples`` samples."""
        if self.steps is not None:
            return [b for t, b in self.steps if t <= consumed_samples][-1]
        if self.ramp is None:
            return self.global_batch_size
        start, inc, samples, per_increment = self.ramp
        if consumed_samples > samples or per_increment == 0.0:
            return self.global_batch_size
        return min(start + int(consumed_samples / per_increment) * inc, self.global_batch_size)

    def num_microbatches(self, consumed_samples: int) -> int:
        return self.global_batch(consumed_samples) // self.per_micro_step

    def eval_microbatches(self, consumed_samples: int) -> int:
        """Micro-batches of an evaluation step: --eval-global-batch-size's; with a step schedule
        --global-batch-size's (Megatron's default), else the current training step's (the ramp, as Megatron's did)."""
        if self.eval_global_batch_size is not None:
            return self.eval_global_batch_size // self.per_micro_step
        if self.steps is not None:
            return self.global_batch_size // self.per_micro_step
        return self.num_microbatches(consumed_samples)

    def batch_sizes_from(self, consumed_samples: int) -> list[int]:
        """Every global batch size a run at ``consumed_samples`` can still reach (ascending, no repeats)."""
        if self.steps is not None:
            now = self.global_batch(consumed_samples)
            return [now] + [b for t, b in self.steps if t > consumed_samples and b != now]
        return sorted({self.global_batch(consumed_samples), self.global_batch_size})

    def train_iters_for_samples(self, train_samples: int) -> int:
        """Iterations that ``--train-samples`` makes (Megatron's count: with a ramp, the ramp phase
        step by step, then whole global batches, a partial last batch dropped; with a step schedule,
        steps until at least ``train_samples`` are consumed, the last one counted whole)."""
        if self.steps is not None:
            return self._steps_for_samples(train_samples)
        if self.ramp is None:
            return train_samples // self.global_batch_size
        iters = consumed = 0
        while consumed <= self.ramp[2] and consumed <= train_samples:
            consumed += self.global_batch(consumed)
            iters += 1
        if train_samples > consumed:
            iters += (train_samples - consumed) // self.global_batch_size
        return iters

    def samples_for_iters(self, iters: int) -> int:
        """Samples the first ``iters`` steps of a step schedule consume (counted per entry, as runs of equal
        steps); without a schedule ``iters`` x the global batch."""
        if self.steps is None:
            return iters * self.global_batch_size
        consumed, left = 0, iters
        bounds = [t for t, _ in self.steps[1:]] + [None]
        for (_, batch), end in zip(self.steps, bounds):
            n = left if end is None else min(left, max(-(-(end - consumed) // batch), 0))
            consumed, left = consumed + n * batch, left - n
        return consumed

    def _steps_for_samples(self, train_samples: int) -> int:
        """Megatron's loop ``while consumed < train_samples: consumed += batch(consumed)``, counted
        per schedule entry (each entry is a run of equal steps) rather than step by step."""
        iters = consumed = 0
        bounds = [t for t, _ in self.steps[1:]] + [train_samples]
        for (_, batch), end in zip(self.steps, bounds):
            target = min(end, train_samples)
            if consumed < target:
                n = -(-(target - consumed) // batch)  # steps until this entry's end is reached
                iters, consumed = iters + n, consumed + n * batch
            if consumed >= train_samples:
                break
        return iters


def check_batch_sizes(micro: MicroBatches, consumed_samples: int, dims, micro_batch_size: int,
                      evaluates: bool = True) -> None:
    """Before training (after a resume): every global batch size still to come splits into micro-batches
    over the data-parallel ranks, in a number the pipeline schedule takes, and so does an evaluation
    step's (``evaluates``) (one-line ConfigErrors)."""
    from ..config import ConfigError
    from ..parallel.pipeline import check_pipeline_schedule
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

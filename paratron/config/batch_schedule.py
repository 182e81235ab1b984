"""The batch-size schedule: ``--step-batch-size-schedule`` parsed, and how many micro-batches a step runs
(:class:`MicroBatches`: constant, following ``--rampup-batch-size START INCREMENT SAMPLES``, Megatron's
former RampupBatchsizeNumMicroBatchesCalculator, or following the step schedule, Megatron's
StepBatchsizeNumMicroBatchesCalculator). Pure arithmetic of the config's values: resolve derives
``--train-iters`` of ``--train-samples`` with it, the training loop (paratron/train/microbatches.py) runs it.

With a ramp the global batch starts at START and grows by INCREMENT each SAMPLES / num_increments
consumed samples until it reaches ``--global-batch-size``. With a step schedule the global batch is
the BS of the last entry whose THRESHOLD (in samples, see :func:`step_schedule`) is at most the samples
consumed. Either way it depends only on the number of samples consumed before the step, so a resumed
run continues the schedule exactly. The data iterator needs no change: each data-parallel rank simply
draws more micro-batches per step, and the ranks together consume exactly the current global batch.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ConfigError
from .rules import need

SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _number(text: str, schedule: str) -> int:
    """A schedule number: an int or float with an optional K/M/B/T suffix, truncated as Megatron's
    ``int(float(value) * multiplier)``."""
    t = text.strip().upper()
    scale = SUFFIXES.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        return int(float(t) * scale)
    except ValueError:
        raise ConfigError(f"--step-batch-size-schedule {schedule!r}: {text!r} is not a number (K/M/B/T suffixes "
                          "allowed)") from None


def step_schedule(schedule: str, seq_length: Optional[int]) -> list[tuple[int, int]]:
    """``--step-batch-size-schedule`` as [(threshold in samples, global batch size)], sorted: entries
    ``THRESHOLD:BS`` separated by spaces or commas; thresholds are tokens, turned into samples by
    ``// seq_length`` (Megatron passes --seq-length; without one they are samples)."""
    entries = schedule.replace(",", " ").split()
    need(entries, "--step-batch-size-schedule is empty; give entries THRESHOLD:BS, the first at threshold 0")
    out = []
    for entry in entries:
        need(":" in entry, f"--step-batch-size-schedule entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch = entry.split(":", 1)
        t = _number(threshold, schedule)
        out.append((t // seq_length if seq_length else t, _number(batch, schedule)))
    out.sort(key=lambda e: e[0])
    need(out[0][0] == 0, f"--step-batch-size-schedule {schedule!r}: the first entry must have threshold 0 "
                         f"(the smallest is {out[0][0]} samples)")
    for (a, _), (b, _) in zip(out, out[1:]):
        need(b > a, f"--step-batch-size-schedule {schedule!r}: thresholds must be strictly increasing in samples "
                    f"(two entries fall on {a} samples after dividing tokens by --seq-length)")
    for _, bs in out:
        need(bs > 0, f"--step-batch-size-schedule {schedule!r}: batch sizes must be positive (got {bs})")
    return out


def schedule_of(cfg) -> Optional[list[tuple[int, int]]]:
    """The parsed --step-batch-size-schedule of ``cfg`` (None without one)."""
    tr = cfg.train
    return None if tr.step_batch_size_schedule is None else step_schedule(tr.step_batch_size_schedule,
                                                                          cfg.model.seq_length)


class MicroBatches:
    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: Optional[list] = None, steps: Optional[Sequence[tuple[int, int]]] = None,
                 eval_global_batch_size: Optional[int] = None):
        """``steps``: the parsed step schedule, [(threshold in samples, global batch)] with thresholds
        increasing from 0 (step_schedule below); ``eval_global_batch_size``:
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

"""How many micro-batches a step runs: constant, or following ``--rampup-batch-size START INCREMENT
SAMPLES`` (Megatron's RampupBatchsizeNumMicroBatchesCalculator).

With a ramp the global batch starts at START and grows by INCREMENT each SAMPLES / num_increments
consumed samples until it reaches ``--global-batch-size``; it depends only on the number of samples
consumed before the step, so a resumed run continues the ramp exactly. The data iterator needs no
change: each data-parallel rank simply draws more micro-batches per step, and the ranks together
consume exactly the current global batch.
"""
from __future__ import annotations

from typing import Optional


class MicroBatches:
    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: Optional[list] = None):
        self.global_batch_size = global_batch_size
        self.per_micro_step = micro_batch_size * data_parallel_size  # samples per micro-batch, all ranks
        self.ramp = None
        if rampup_batch_size is not None:
            start, inc, samples = (int(v) for v in rampup_batch_size)
            increments = (global_batch_size - start) // inc
            self.ramp = (start, inc, samples, samples / increments if increments else 0.0)

    def global_batch(self, consumed_samples: int) -> int:
        """The global batch size of the step that starts after ``consumed_samples`` samples."""
        if self.ramp is None:
            return self.global_batch_size
        start, inc, samples, per_increment = self.ramp
        if consumed_samples > samples or per_increment == 0.0:
            return self.global_batch_size
        return min(start + int(consumed_samples / per_increment) * inc, self.global_batch_size)

    def num_microbatches(self, consumed_samples: int) -> int:
        return self.global_batch(consumed_samples) // self.per_micro_step

    def train_iters_for_samples(self, train_samples: int) -> int:
        """Iterations that ``--train-samples`` makes (Megatron's count: the ramp phase step by step,
        then whole global batches; a partial last batch is dropped)."""
        if self.ramp is None:
            return train_samples // self.global_batch_size
        iters = consumed = 0
        while consumed <= self.ramp[2] and consumed <= train_samples:
            consumed += self.global_batch(consumed)
            iters += 1
        if train_samples > consumed:
            iters += (train_samples - consumed) // self.global_batch_size
        return iters

"""Micro-batches for each data-parallel rank, resumable from a count of consumed samples.

The dataset already holds samples in their shuffled order, so the sampler walks it in order
(Megatron's MegatronPretrainingSampler): the stream is cut into chunks of
micro_batch_size x dp_size samples, and data-parallel rank r takes the contiguous block
[r * mbs, (r + 1) * mbs) of each chunk. A global batch is num_micro_batches such chunks, so the
D ranks together see exactly global_batch_size consecutive samples per step. Starting at
`consumed_samples` (what the checkpoint saved) continues the stream exactly where it stopped.
"""

from __future__ import annotations

import gc
from typing import Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, default_collate

from paratron.data.errors import DataError


class PretrainingSampler:
    """Batch sampler: the sample indices of this rank's micro-batches, from `consumed_samples`."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise DataError(f"sampler: the dataset has no samples ({total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise DataError(f"sampler: {consumed_samples} samples consumed of {total_samples}; "
                            "nothing left to read")
        if micro_batch_size < 1:
            raise DataError(f"--micro-batch-size {micro_batch_size}: must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise DataError(f"data-parallel rank {data_parallel_rank} not in [0, "
                            f"{data_parallel_size})")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.rank = int(data_parallel_rank)
        self.size = int(data_parallel_size)
        self.drop_last = drop_last

    @property
    def chunk(self) -> int:
        return self.micro_batch_size * self.size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.chunk)
        return full + int(not self.drop_last and rest > self.rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[List[int]]:
        mbs, start = self.micro_batch_size, self.consumed_samples
        full = (self.total_samples - start) // self.chunk
        for k in range(full):
            first = start + k * self.chunk + self.rank * mbs
            yield list(range(first, first + mbs))
        if not self.drop_last:  # the last, partial chunk: whatever falls in this rank's block
            first = start + full * self.chunk + self.rank * mbs
            last = min(first + mbs, self.total_samples)
            if first < last:
                yield list(range(first, last))


class CyclicSampler:
    """Batch sampler of ``--dataloader-type cyclic`` (Megatron's random sampler): epoch after epoch over
    the dataset, each in a new random order (``torch.randperm`` seeded with the epoch number, as
    Megatron's), from ``consumed_samples`` (so a resumed run goes on with the same order). An epoch is
    the dataset's samples less the last partial chunk of micro_batch_size x dp_size. With data sharding
    (Megatron's default; ``--no-data-sharding`` turns it off) rank r draws, in shuffled order, from its
    own contiguous bucket of the dataset; without, the epoch's permutation of the whole dataset is dealt
    to the ranks in turn. Never ends: the caller stops it."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, data_sharding: bool = True):
        self.mbs, self.rank, self.size = micro_batch_size, data_parallel_rank, data_parallel_size
        self.sharding = data_sharding
        self.total, self.chunk = int(total_samples), micro_batch_size * data_parallel_size
        self.epoch_samples = self.total - self.total % self.chunk
        if self.epoch_samples <= 0:
            raise DataError(f"--dataloader-type cyclic: the dataset of {self.total} samples holds no chunk of "
                            f"--micro-batch-size x data-parallel size = {self.chunk}")
        self.consumed = int(consumed_samples)
        if self.consumed % self.chunk:
            raise DataError(f"--dataloader-type cyclic: {self.consumed} consumed samples are not whole chunks of "
                            f"{self.chunk}; resume with the micro-batch size and data-parallel size that saved them")

    def _epoch_indices(self, epoch: int, offset: int) -> List[int]:
        g = torch.Generator().manual_seed(epoch)
        if self.sharding:
            bucket = (self.total // self.chunk) * self.mbs
            perm = torch.randperm(bucket, generator=g)[offset // self.size:]
            return (perm + self.rank * bucket).tolist()
        perm = torch.randperm((self.total // self.mbs) * self.mbs, generator=g)[offset:]
        return perm[self.rank::self.size].tolist()

    def __iter__(self) -> Iterator[List[int]]:
        consumed = self.consumed
        while True:
            epoch, offset = divmod(consumed, self.epoch_samples)
            indices = self._epoch_indices(epoch, offset)
            for k in range((self.epoch_samples - offset) // self.chunk):  # every rank the same count
                consumed += self.chunk
                yield indices[k * self.mbs:(k + 1) * self.mbs]


def build_data_iterator(
    dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
    num_workers: int = 0, infinite: bool = False, worker_init_fn=None, cyclic: bool = False,
    data_sharding: bool = True,
) -> Optional[LoaderIterator]:
    """An iterator of collated micro-batches (dicts of stacked tensors) for one DP rank.

    `num_workers` > 0 loads in background processes (persistent; memory pinned when CUDA is
    there; `worker_init_fn` runs first in each worker). `infinite` restarts the stream from `consumed_samples` each time it runs out, as
    Megatron's cyclic validation iterator does; otherwise the iterator ends with the data. `cyclic`
    (``--dataloader-type cyclic``) samples with :class:`CyclicSampler` instead (endless, reshuffled
    each epoch). Returns None for a None dataset."""
    if dataset is None:
        return None
    total = len(dataset)
    if cyclic:
        sampler = CyclicSampler(total, consumed_samples, micro_batch_size, dp_rank, dp_size, data_sharding)
        infinite = False  # the sampler itself never ends
    else:
        if infinite and total > 0:
            consumed_samples %= total
        sampler = PretrainingSampler(total, consumed_samples, micro_batch_size, dp_rank, dp_size)
    if infinite and len(sampler) == 0:
        raise DataError(f"dataset of {total} samples holds no full micro-batch chunk of "
                        f"{sampler.chunk} after {consumed_samples} consumed")
    # A private generator: the loader draws a worker base seed each time an iteration starts, and
    # must not advance the global RNG that dropout uses (resume would no longer be bit-exact).
    loader = DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=default_collate,
        pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=_WorkerStart(worker_init_fn) if num_workers > 0 else None,
    )
    return LoaderIterator(loader, endless=infinite)


class _WorkerStart:
    """What a worker process runs first: the objects it inherited from the trainer by fork move to the collector's
    permanent generation (a garbage cycle of the parent's holding pinned or CUDA memory must not be freed in a
    child, where CUDA cannot run: the worker aborts), then the caller's ``worker_init_fn``."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, worker_id: int) -> None:
        gc.freeze()
        if self.then is not None:
            self.then(worker_id)


def _iterate(loader: DataLoader):
    """``iter(loader)``; where that forks the worker processes, the parent's garbage is collected first, so that
    no child inherits a cycle to free (see :class:`_WorkerStart`)."""
    if loader.num_workers > 0 and getattr(loader, "_iterator", None) is None:
        gc.collect()
    return iter(loader)


class LoaderIterator:
    """The micro-batches of a DataLoader: one pass, or (``endless``) restarted from its start point each
    time it runs out, as Megatron's cyclic validation iterator. One pass starts the loader's workers at
    once; an endless one at its first batch (a validation stream may never be read).

    :meth:`close` stops the worker processes (the trainer's close() does). Left to the garbage collector,
    which is what frees a trainer (its gradient hooks make reference cycles), they stop slowly: the
    collector runs multiprocessing's finalizers first, which end the feeder threads of the loader's index
    queues, so the workers never get the stop message the iterator's ``__del__`` then sends, and torch waits
    5 s (its ``MP_STATUS_CHECK_INTERVAL``) for each before terminating it."""

    def __init__(self, loader: DataLoader, endless: bool):
        self.loader, self.endless = loader, endless
        self._it = None if endless else _iterate(loader)

    def __iter__(self) -> "LoaderIterator":
        return self

    def __next__(self) -> dict:
        if self.loader is None:  # closed
            raise StopIteration
        if self._it is not None:
            try:
                return next(self._it)
            except StopIteration:
                if not self.endless:
                    raise
        self._it = _iterate(self.loader)  # persistent workers: the same processes, the sampler from its start
        return next(self._it)

    def close(self) -> None:
        """Stop the loader's worker processes now (a no-op without workers); the iterator then ends."""
        it, self._it, self.loader = self._it, None, None
        shutdown = getattr(it, "_shutdown_workers", None)  # torch's multi-process iterator (idempotent)
        if shutdown is not None:
            shutdown()

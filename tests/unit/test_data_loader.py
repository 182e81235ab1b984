"""Resumable data-parallel sampler and the micro-batch iterator."""

import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import StubTokenizer, build_datasets, data_args, random_documents  # noqa: E402

from paratron.data import DataError  # noqa: E402
from paratron.data.indexed import write_dataset  # noqa: E402
from paratron.data.loader import PretrainingSampler, build_data_iterator  # noqa: E402


class Numbers(torch.utils.data.Dataset):
    """Sample i is just i, so batches show which samples they hold."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i, i]), "loss_mask": torch.ones(2)}


def _stream(total, consumed, mbs, rank, size):
    return list(PretrainingSampler(total, consumed, mbs, rank, size))


def test_dp_slices_cover_each_global_batch_exactly():
    mbs, dp, num_micro = 2, 3, 4
    gbs = mbs * dp * num_micro
    per_rank = [_stream(100, 0, mbs, r, dp) for r in range(dp)]
    assert per_rank[1][0] == [2, 3]  # rank r takes block [r*mbs, (r+1)*mbs) of each chunk
    steps = len(per_rank[0]) // num_micro
    for step in range(steps):
        seen = []
        for r in range(dp):
            for batch in per_rank[r][step * num_micro:(step + 1) * num_micro]:
                assert len(batch) == mbs
                seen.extend(batch)
        assert sorted(seen) == list(range(step * gbs, (step + 1) * gbs))


def test_resume_gives_the_same_remaining_stream():
    for rank in range(2):
        full = _stream(101, 0, 4, rank, 2)
        for consumed_batches in (0, 1, 5, 12):
            resumed = _stream(101, consumed_batches * 8, 4, rank, 2)
            assert resumed == full[consumed_batches:]
    sampler = PretrainingSampler(101, 16, 4, 0, 2)
    assert len(sampler) == len(list(sampler)) == (101 - 16) // 8


def test_partial_last_chunk_and_errors():
    assert list(PretrainingSampler(10, 0, 2, 1, 2, drop_last=False)) == [[2, 3], [6, 7]]
    assert list(PretrainingSampler(10, 0, 2, 0, 2, drop_last=False))[-1] == [8, 9]
    for bad in [(0, 0, 1, 0, 1), (10, 10, 1, 0, 1), (10, 0, 0, 0, 1), (10, 0, 1, 2, 2)]:
        with pytest.raises(DataError):
            PretrainingSampler(*bad)


def test_iterator_collates_and_resumes():
    it = build_data_iterator(Numbers(40), 0, micro_batch_size=3, dp_rank=1, dp_size=2,
                             num_workers=0)
    first = next(it)
    assert first["tokens"].shape == (3, 2) and first["tokens"][:, 0].tolist() == [3, 4, 5]
    rest = [b["tokens"][:, 0].tolist() for b in it]
    resumed = build_data_iterator(Numbers(40), 6, 3, 1, 2, num_workers=0)
    assert [b["tokens"][:, 0].tolist() for b in resumed] == rest
    assert build_data_iterator(None, 0, 1, 0, 1) is None


def test_infinite_cycles_from_the_start_point():
    it = build_data_iterator(Numbers(10), 4, 2, 0, 1, num_workers=0, infinite=True)
    got = [b["tokens"][:, 0].tolist() for b in itertools.islice(it, 5)]
    assert got == [[4, 5], [6, 7], [8, 9], [4, 5], [6, 7]]


def test_background_workers_give_the_same_batches(tmp_path):
    write_dataset(str(tmp_path / "d"), random_documents(80, 3))
    args = data_args(data_path=[str(tmp_path / "d")], data_cache_path=str(tmp_path / "c"),
                     reset_attention_mask=True)
    train, _, _ = build_datasets(args, StubTokenizer())
    plain = build_data_iterator(train, 8, 2, 0, 2, num_workers=0)
    workers = build_data_iterator(train, 8, 2, 0, 2, num_workers=2)
    for a, b in zip(itertools.islice(plain, 6), itertools.islice(workers, 6)):
        assert set(a) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
        assert a["document_ids"].shape == (2, 32)
        for key in a:
            assert torch.equal(a[key], b[key])


class _Cycle:
    """Garbage in a reference cycle whose finalizer notes the process that ran it (the stand-in for a trainer's
    pinned batches or CUDA tensors, which a forked worker must never free: CUDA cannot run there)."""

    def __init__(self, freed_in: list):
        self.freed_in, self.me = freed_in, self

    def __del__(self):
        self.freed_in.append(os.getpid())


class _WorkerFacts(Numbers):
    """Sample i: i, whether the process has frozen its objects, and its torch seed (what worker_init_fn set)."""

    def __getitem__(self, i):
        import gc
        return {"tokens": torch.tensor([i, i]), "frozen": torch.tensor(gc.get_freeze_count() > 0),
                "seed": torch.tensor(torch.initial_seed())}


@pytest.mark.parametrize("endless", [False, True], ids=["one-pass", "endless"])
def test_workers_start_with_no_garbage_to_free(endless):
    """The parent's garbage is collected before the workers fork (so no worker inherits a cycle to free), the
    workers freeze what they inherited, and a caller's worker_init_fn still runs in each."""
    import gc
    freed_in: list = []
    gc.disable()  # (no automatic collection may free the cycle first: only the loader's own)
    try:
        _Cycle(freed_in)
        it = build_data_iterator(_WorkerFacts(16), 0, 2, 0, 1, num_workers=1, infinite=endless,
                                 worker_init_fn=lambda i: torch.manual_seed(100 + i))
        assert freed_in == ([] if endless else [os.getpid()])  # an endless one starts its workers at its first batch
        first = next(it)
        assert freed_in == [os.getpid()]
        assert torch.equal(first["tokens"], torch.tensor([[0, 0], [1, 1]]))
        assert first["frozen"].all() and (first["seed"] == 100).all()
        it.close()
    finally:
        gc.enable()

"""--dataloader-type cyclic (Megatron's random sampler): epochs reshuffled by their number, every rank
the same number of micro-batches, data sharding (each rank its own bucket) or not, and a resume from
the consumed samples continues the same order; the flag reaches the Trainer's loader."""
import itertools

import pytest
import torch

from paratron.config import ConfigError, parse_args
from paratron.data.errors import DataError
from paratron.data.loader import CyclicSampler


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


@pytest.mark.parametrize("sharding", [True, False])
def test_epochs_cover_the_data_once_each_in_a_new_order(sharding):
    total, mbs, dp = 26, 2, 3  # chunk 6: an epoch is 24 samples, 4 micro-batches per rank
    per_rank = [take(CyclicSampler(total, 0, mbs, r, dp, sharding), 8) for r in range(dp)]
    for epoch in (0, 1):
        seen = [i for r in range(dp) for batch in per_rank[r][4 * epoch:4 * epoch + 4] for i in batch]
        assert len(seen) == 24 and len(set(seen)) == 24 and max(seen) < total  # each sample at most once
    assert per_rank[0][:4] != per_rank[0][4:]  # epoch 1 is another order
    if sharding:  # rank r draws from its own bucket of 8 samples
        for r in range(dp):
            assert {i for b in per_rank[r] for i in b} <= set(range(8 * r, 8 * r + 8))
    expect = torch.randperm(8 if sharding else 26, generator=torch.Generator().manual_seed(0)).tolist()
    assert per_rank[0][0] == (expect[:2] if sharding else expect[0::3][:2])  # Megatron's seeding: the epoch


def test_resume_continues_the_same_order():
    whole = take(CyclicSampler(26, 0, 2, 1, 3), 10)
    for done in (1, 4, 6):  # micro-batches per rank already consumed (steps of the whole DP group)
        assert take(CyclicSampler(26, done * 6, 2, 1, 3), 10 - done) == whole[done:]
    with pytest.raises(DataError, match="not whole chunks of 6"):
        CyclicSampler(26, 5, 2, 1, 3)
    with pytest.raises(DataError, match="holds no chunk"):
        CyclicSampler(4, 0, 2, 0, 3)


def test_flags():
    base = ["--config", "tiny", "--mock-data", "--train-iters", "1"]
    with pytest.raises(ConfigError, match="--no-data-sharding has no effect without --dataloader-type cyclic"):
        parse_args(base + ["--no-data-sharding"])
    with pytest.raises(ConfigError, match="--dataloader-type external .*Trainer\\(cfg, data="):
        parse_args(base + ["--dataloader-type", "external"])
    assert parse_args(base + ["--dataloader-type", "cyclic", "--no-data-sharding"]).data.no_data_sharding


def test_trainer_trains_with_it(monkeypatch):
    from tests.unit.test_train import TINY, losses_of
    from paratron.data import loader
    from paratron.train.loop import Trainer
    made = []
    real = loader.CyclicSampler.__init__

    def record(self, *args):
        made.append(args)
        real(self, *args)
    monkeypatch.setattr(loader.CyclicSampler, "__init__", record)
    t = Trainer(parse_args(TINY + ["--train-iters", "3", "--dataloader-type", "cyclic", "--no-data-sharding",
                                   "--device", "cpu"]))
    try:
        assert all(torch.isfinite(torch.tensor(losses_of(t, 3))))
        assert made and made[0][5] is False  # the training split's sampler, without data sharding
    finally:
        t.close()

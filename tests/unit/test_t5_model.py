"""The T5 model's own pieces: relative buckets by hand, recomputation giving the same gradients, the config's
T5 errors before step 1."""
import pytest
import torch

from paratron.config import ConfigError
from paratron.model.relative import relative_bucket
from paratron.model.t5 import T5Model
from tests.parallel.t5_cases import batch, tiny_config


def test_relative_buckets_by_hand():
    rel = torch.tensor([-20, -5, -1, 0, 1, 3, 5, 20])
    # bidirectional, 8 buckets, max distance 20: 4 per side, exact below 2, then log-spaced up to bucket 3
    assert relative_bucket(rel, True, 8, 20).tolist() == [3, 2, 1, 0, 5, 6, 6, 7]
    # one-way (the decoder), exact below 4: 5 -> 4 + floor(log(5/4) / log(20/4) * 4) = 4; keys after the query: 0
    assert relative_bucket(rel, False, 8, 20).tolist() == [7, 4, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_same_gradients(granularity):
    enc, dec, pad = batch()

    def grads(g):
        torch.manual_seed(0)
        model = T5Model(tiny_config(), 96, recompute_granularity=g).train()
        model(enc, dec, pad, labels=dec.roll(-1, 1)).sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}
    want, got = grads(None), grads(granularity)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("flags, message", [
    (["--encoder-num-layers", "2"], "has no decoder"),
    (["--model", "t5", "--vocab-extra-ids", "10", "--pipeline-model-parallel-size", "2"],
     "Megatron refuses pipeline parallelism for T5"),
    (["--model", "t5", "--vocab-extra-ids", "10", "--context-parallel-size", "2"], "--context-parallel-size > 1"),
    (["--model", "t5"], "--vocab-extra-ids"),
    (["--model", "t5", "--vocab-extra-ids", "10", "--decoder-num-layers", "0"], "--decoder-num-layers must be >= 1"),
])
def test_config_errors(flags, message):
    from paratron.train.resolve import parse_args
    base = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--train-iters", "3", "--lr", "1e-3",
            "--hidden-size", "32", "--num-attention-heads", "4", "--data-path", "x", "--attention-dropout", "0"]
    with pytest.raises(ConfigError, match=message):
        parse_args(base + flags, world_size=4)

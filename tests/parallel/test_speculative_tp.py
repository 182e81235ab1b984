"""Speculative decoding at TP=2 (gloo) equals TP=1: a model with two MTP depths split over two ranks (its weights
the one-rank model's, sliced), a greedy and a seeded sampled row, rank 0 leading and rank 1 following."""
from __future__ import annotations

import pytest
import torch

from paratron.checkpoint.state import sharded_state_dict
from paratron.inference.engine import Engine, Request
from paratron.inference.runtime import Group
from paratron.inference.sampling import SamplingParams
from paratron.model.gpt import GPTModel
from paratron.parallel.dims import initialize_model_parallel
from tests.dist import run_ranks
from tests.unit.test_generate import PROMPTS, VOCAB
from tests.unit.test_speculative import bigram_drafter, mtp_model

PARAMS = [SamplingParams(max_new_tokens=8, logprobs=True), SamplingParams(max_new_tokens=8, temperature=0.8, seed=4)]


def _generate(rank, world, state):
    dims = initialize_model_parallel(world)
    one = mtp_model(layers=1)
    model = GPTModel(one.config, 128, dims=dims, seed=3).eval()
    with torch.no_grad():  # this rank's slices of the one-rank weights
        for p in sharded_state_dict(model):
            full = state[p.key[len("model."):]]
            p.tensor.copy_(full[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.tensor.shape))])
    group = Group(Engine(model, VOCAB, num_speculative_tokens=2), dims)
    if rank != 0:
        group.follow()
        return None
    results = group.generate([Request(p, sp) for p, sp in zip(PROMPTS, PARAMS)])
    group.close()
    return [(r.tokens, r.logprobs) for r in results], group.engine.acceptance.drafted


@pytest.mark.slow
def test_speculative_tp2_equals_tp1(tmp_path):
    state = bigram_drafter(mtp_model(layers=1), attention=0.3, noise=0.7).state_dict()
    one = _generate(0, 1, state)
    two = run_ranks(2, _generate, state, tmp_dir=tmp_path)[0]
    assert one[1] == two[1] > 0  # as many drafts proposed
    for (t1, lp1), (t2, lp2) in zip(one[0], two[0]):
        assert t1 == t2
        if lp1 is not None:
            assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)

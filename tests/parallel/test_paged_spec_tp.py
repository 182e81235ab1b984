"""Speculative decoding in the paged engine at TP = 2 (gloo) equals TP = 1: mixed-length concurrent requests under
a small token budget and pool (chunked prefill, preemption), greedy rows equal plain paged decoding's and seeded
sampled rows the TP 1 speculative engine's, with drafts mostly rejected (random MTP depths) and mostly accepted
(depths that predict as the model does); both ranks end with the same counts and every block given back (rank 0
leads each step, rank 1 follows: paratron.inference.runtime.Group.paged / follow); unseeded sampled requests, whose
draws differ between the ranks, leave both ranks in the same state (rank 0's drafts and acceptances are kept)."""
from __future__ import annotations

import random

import pytest
import torch

from paratron.checkpoint.state import sharded_state_dict
from paratron.config.inference import InferenceConfig
from paratron.inference.engine import Engine, Request
from paratron.inference.paged import PagedEngine
from paratron.inference.paged_spec import build_paged
from paratron.inference.runtime import Group
from paratron.inference.sampling import SamplingParams
from paratron.model.gpt import GPTModel
from paratron.parallel.dims import initialize_model_parallel
from tests.dist import run_ranks
from tests.unit.test_generate import VOCAB
from tests.unit.test_speculative import bigram_drafter, mtp_model

CFG = InferenceConfig(inference_dynamic_batching=True, inference_dynamic_batching_block_size=4,
                      inference_dynamic_batching_num_blocks=8, inference_dynamic_batching_max_tokens=8,
                      inference_dynamic_batching_max_requests=8, enable_chunked_prefill=True)
SAMPLED = (2, 5)  # the rows that sample (seeded)


def requests() -> list[Request]:
    rng = random.Random(3)
    out = []
    for i in range(10):
        sampled = dict(temperature=0.8, top_k=8, seed=i) if i in SAMPLED else {}
        out.append(Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 16))],
                           SamplingParams(max_new_tokens=rng.randint(4, 12), logprobs=i % 3 == 0, **sampled)))
    return out


def state_of(paged) -> dict:
    """What must agree between ranks: the counts, and a pool with every block given back."""
    b, stats = paged.blocks, paged.stats()
    free = sorted(list(b.free) + list(b.evictable)) == list(range(1, paged.num_blocks))
    return {"free": free and stats["kv_blocks_used"] == 0 and not any(b.refs) and paged.idle and not paged.windows,
            **{k: v for k, v in stats.items() if k.startswith("speculative") or k in ("preemptions", "steps")}}


def _paged(rank, world, layers, state, k):
    dims = initialize_model_parallel(world)
    model = GPTModel(mtp_model(layers=layers).config, 128, dims=dims, seed=3).eval()
    with torch.no_grad():  # this rank's slices of the one-rank weights
        for p in sharded_state_dict(model):
            full = state[p.key[len("model."):]]
            p.tensor.copy_(full[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.tensor.shape))])
    group = Group(Engine(model, VOCAB, num_speculative_tokens=k), dims)
    torch.manual_seed(100 + rank)  # unseeded rows draw differently on each rank: rank 0's decisions must be kept
    if rank != 0:
        return state_of(group.follow())
    engine = group.paged(CFG) if world > 1 else build_paged(group.engine, CFG)
    results = engine.generate(requests())
    first = state_of(engine)
    unseeded = SamplingParams(max_new_tokens=9, temperature=1.0)  # a second round, blocks reused
    engine.generate([Request([1, 2], unseeded), Request([3, 4, 5], unseeded), Request([6], unseeded)])
    group.close()
    return [(r.tokens, r.logprobs) for r in results], first, state_of(engine)


@pytest.mark.parametrize("case", ["rejected", "accepted"])
def test_paged_speculative_tp2_equals_tp1(tmp_path, case):
    model = mtp_model() if case == "rejected" else bigram_drafter(mtp_model(layers=1), attention=0.3, noise=0.7)
    layers, state = len(model.decoder.layers), model.state_dict()
    plain = PagedEngine(Engine(model, VOCAB), CFG).generate(requests())
    one, one_state, _ = _paged(0, 1, layers, state, 2)
    (two, two_state, leader), follower = run_ranks(2, _paged, layers, state, 2, tmp_dir=tmp_path)
    assert one_state["free"] and one_state["preemptions"] > 0 and one_state["speculative_drafted"] > 20
    if case == "rejected":
        assert one_state["speculative_acceptance_rate"] < 0.3, one_state
    else:
        assert one_state["speculative_acceptance_rate"] > 0.6, one_state
    assert two_state == one_state  # the same schedule and acceptance as at TP 1
    assert follower == leader and leader["free"]  # every rank stepped alike, unseeded rows too
    assert leader["speculative_drafted"] > one_state["speculative_drafted"]
    for i, ((t1, lp1), (t2, lp2)) in enumerate(zip(one, two)):
        assert t1 == t2, i
        if i < len(plain) and i not in SAMPLED:
            assert t1 == plain[i].tokens, i
        if lp1 is not None:
            assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)

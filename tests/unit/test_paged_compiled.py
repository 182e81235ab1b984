"""The paged engine under --torch-compile: the steps that are not decode-only run through one compiled graph
whose sizes are symbolic (inference/paged_graphs.py MixedStep), and give the uncompiled engine's tokens."""
from __future__ import annotations

import random

import torch
from torch._dynamo.utils import counters

from paratron.config.inference import InferenceConfig
from paratron.inference.engine import Engine, Request
from paratron.inference.paged import PagedEngine
from paratron.inference.sampling import SamplingParams
from tests.unit.test_generate import VOCAB, tiny_model


def test_steps_of_every_size_run_one_compiled_graph_and_give_the_eager_tokens():
    model = tiny_model()
    for m in model.modules():  # the embedding's id check reads the ids on CPU tensors (a graph break)
        if hasattr(m, "check_ids"):
            m.check_ids = False
    base = dict(inference_dynamic_batching_block_size=4, inference_dynamic_batching_max_tokens=24,
                enable_chunked_prefill=True, inference_dynamic_batching_num_blocks=300)
    rng = random.Random(0)
    reqs = [Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_new_tokens=rng.randint(1, 12))) for _ in range(20)]
    want = PagedEngine(Engine(model, VOCAB), InferenceConfig(**base)).generate(reqs)
    torch._dynamo.reset()
    counters.clear()
    paged = PagedEngine(Engine(model, VOCAB, compile=True), InferenceConfig(**base))
    assert paged.mixed is not None
    paged.warm_up()  # compiles before the first request (two padding tokens: no size specialised)
    assert counters["frames"]["ok"] == 1
    got = paged.generate(reqs)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    # one request's single token, a full budget of prompt chunks and decodes alone all came through it
    assert paged.steps > 20
    assert counters["frames"]["ok"] == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_prefix_cache_hits_run_the_compiled_step_and_compute_only_their_uncached_tokens():
    """Requests sharing a prefix of several blocks (one prompt exactly the prefix, on a block boundary), each added
    while the others decode: under --torch-compile each hit is admitted in one step that computes only the tokens
    past its cached blocks and gives its first token, all through the one compiled graph (none left eager), and
    the tokens equal the engine's without prefix caching."""
    model = tiny_model()
    for m in model.modules():
        if hasattr(m, "check_ids"):
            m.check_ids = False
    bs, rng = 4, random.Random(1)
    prefix = [rng.randrange(1, VOCAB) for _ in range(6 * bs)]
    reqs = [Request(prefix + [rng.randrange(1, VOCAB) for _ in range(k)], SamplingParams(max_new_tokens=6))
            for k in (3, 0, 5, 1, 7, 2)]

    def run(caching: bool) -> tuple:
        torch._dynamo.reset()
        counters.clear()
        cfg = InferenceConfig(inference_dynamic_batching_block_size=bs, inference_dynamic_batching_max_tokens=64,
                              enable_chunked_prefill=True, inference_dynamic_batching_num_blocks=100,
                              inference_dynamic_batching_prefix_caching=caching)
        paged = PagedEngine(Engine(model, VOCAB, compile=True), cfg)
        paged.warm_up()
        plans, schedule = [], paged.sched.schedule
        paged.sched.schedule = lambda: plans.append(schedule()) or plans[-1]  # (each step's plan kept)
        seqs, computed = [], []
        for req in reqs:
            seqs.append(paged.add(req))
            paged.step()
            computed.append(next(n for s, n in plans[-1] if s is seqs[-1]))
            assert len(seqs[-1].generated) == 1  # its first token in the step that admitted it
        while not paged.idle:
            paged.step()
        return [s.generated for s in seqs], computed, paged.stats()

    plain, plain_computed, _ = run(False)
    got, computed, stats = run(True)
    assert got == plain
    assert plain_computed == [len(r.prompt) for r in reqs]
    # the first computes its whole prompt; the others only past their cached blocks: the prefix's 6, less one when
    # the prompt is the prefix (its last token is computed again: its logits give the first token)
    cached = [min((len(r.prompt) - 1) // bs, 6) for r in reqs[1:]]
    assert cached == [5, 6, 6, 6, 6]
    assert computed == [len(reqs[0].prompt)] + [len(r.prompt) - c * bs for r, c in zip(reqs[1:], cached)]
    assert stats["prefix_cache_hit_blocks"] == sum(cached)
    assert stats["compiled_graphs"] == 1 and stats["frames_not_compiled"] == 0, stats

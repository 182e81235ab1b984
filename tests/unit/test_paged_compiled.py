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

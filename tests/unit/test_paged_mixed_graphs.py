"""The mixed steps' CUDA-graph buckets (inference/paged_mixed_graphs.py) on CPU, without the capture: a step padded
to its token bucket (padding tokens, picks and empty tiles) gives the tokens of the unpadded step, and the tile
bound holds for every step a bucket can take. The capture itself: tests/gpu/test_paged_cuda.py."""
from __future__ import annotations

import random

import pytest

from paratron.errors import ConfigError
from paratron.config.inference import InferenceConfig, check_inference
from paratron.inference.engine import Engine, Request
from paratron.inference.paged import PagedEngine
from paratron.inference.paged_graphs import MixedStep, mixed_graphs_refusal
from paratron.inference.paged_mixed_graphs import MixedGraphs, token_buckets
from paratron.inference.sampling import SamplingParams
from paratron.kernels.paged_attention import tiles_of
from tests.unit.test_generate import VOCAB, tiny_model

BASE = dict(inference_dynamic_batching_block_size=4, inference_dynamic_batching_max_tokens=40,
            enable_chunked_prefill=True, inference_dynamic_batching_num_blocks=300,
            inference_dynamic_batching_max_requests=8)


def _requests(seed: int, shared: list) -> list:
    rng = random.Random(seed)
    return [Request(shared + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_new_tokens=rng.randint(1, 10))) for _ in range(14)]


class _Both(MixedStep):
    """The engine's mixed step (uncompiled) run twice per step: padded to its bucket, then as before; the largest
    logit difference of each padded step kept, the unpadded logits used."""

    def __call__(self, plan, *args, patch=None):
        padded = MixedStep.__call__(self, plan, *args)
        graphs, self.graphs = self.graphs, None
        plain = MixedStep.__call__(self, plan, *args)
        self.graphs = graphs
        if graphs.runs > len(self.diffs):
            self.diffs.append(float((padded - plain).abs().max()))
        return plain


@pytest.mark.parametrize("caching", [False, True])
def test_steps_padded_to_their_token_bucket_give_the_unpadded_logits(caching):
    model = tiny_model()
    for m in model.modules():  # (the embedding's id check would read padded ids: all valid anyway)
        if hasattr(m, "check_ids"):
            m.check_ids = False
    cfg = InferenceConfig(**BASE, inference_dynamic_batching_prefix_caching=caching,
                          inference_dynamic_batching_cuda_graph_mixed_prefill_count=3,
                          inference_dynamic_batching_cuda_graph_max_tokens=32)
    reqs = _requests(2, [5, 6, 7, 8, 9, 10, 11, 12] if caching else [])
    want = PagedEngine(Engine(model, VOCAB), cfg).generate(reqs)
    paged = PagedEngine(Engine(model, VOCAB), cfg)
    step = _Both.__new__(_Both)  # the engine's mixed step without torch.compile, its buckets uncaptured
    step.engine, step.forward, step.diffs = paged, step._forward, []
    step.graphs = MixedGraphs(step, step._forward, 3, 32, capture=False)
    paged.mixed = step
    assert step.graphs.sizes == [32]  # (the budget's 41 tokens are above the cap: those steps run unpadded)
    got = paged.generate(reqs)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert 4 < len(step.diffs) < paged.steps  # steps padded, the largest ones not
    assert max(step.diffs) < 1e-5


def test_token_buckets_and_the_tile_bound():
    assert token_buckets(8192, 16384) == [64, 128, 256, 512, 1024, 2048, 4096, 8192, 8193]
    assert token_buckets(8192, 1000) == [64, 128, 256, 512, 1000]
    assert token_buckets(40, 16384) == [41]
    model = tiny_model()
    paged = PagedEngine(Engine(model, VOCAB), InferenceConfig(**BASE))
    step = MixedStep.__new__(MixedStep)
    step.engine = paged
    graphs = MixedGraphs(step, None, 8, 16384, capture=False)
    rng = random.Random(0)
    for _ in range(300):
        t = rng.choice(graphs.sizes)
        chunks, left = [], t - 1
        while left and len(chunks) < 8:
            chunks.append(rng.randint(1, left))
            left -= chunks[-1]
        assert len(tiles_of(chunks + [1], paged.q_per_group)) <= graphs.tile_bound(t)


def test_mixed_graphs_are_on_by_default_refused_on_cpu_and_checked():
    assert InferenceConfig().inference_dynamic_batching_cuda_graph_mixed_prefill_count == 16  # Megatron's default
    off = PagedEngine(Engine(tiny_model(), VOCAB),
                      InferenceConfig(**BASE, inference_dynamic_batching_cuda_graph_mixed_prefill_count=0))
    assert mixed_graphs_refusal(off).startswith("off")
    on = PagedEngine(Engine(tiny_model(), VOCAB), InferenceConfig(**BASE))
    assert mixed_graphs_refusal(on) == "CUDA graphs need a GPU"
    for bad in (dict(inference_dynamic_batching_cuda_graph_mixed_prefill_count=-1),
                dict(inference_dynamic_batching_cuda_graph_max_tokens=1)):
        with pytest.raises(ConfigError, match=next(iter(bad)).replace("_", "-")):
            check_inference(InferenceConfig(**bad))


def test_bucketed_steps_run_the_one_compiled_graph_of_the_mixed_step():
    """Under --torch-compile the buckets' padded inputs (slices of fixed tensors) match what the mixed step was
    compiled for: warm-up and every step after it run the one compiled graph, none compiled again (on a GPU each
    compilation is half a minute of start-up)."""
    import torch
    from torch._dynamo.utils import counters
    model = tiny_model()
    for m in model.modules():
        if hasattr(m, "check_ids"):
            m.check_ids = False
    paged = PagedEngine(Engine(model, VOCAB, compile=True), InferenceConfig(**BASE))
    step = paged.mixed
    step.graphs = MixedGraphs(step, step.forward, 3, 64, capture=False)
    torch._dynamo.reset()
    counters.clear()
    paged.warm_up()
    assert step.graphs.runs == len(step.graphs.sizes) == 1
    rng = random.Random(0)
    reqs = [Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_new_tokens=rng.randint(1, 8))) for _ in range(10)]
    paged.generate(reqs)
    assert step.graphs.runs > 5
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 1, dict(counters["frames"])

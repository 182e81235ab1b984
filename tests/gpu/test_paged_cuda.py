"""The paged engine on the GPU: the paged-attention Triton kernel against its torch reference in bf16 at llama-1b's
decode shapes (with a sliding window and sinks too, and its split-context path at batch 1, in a CUDA graph too); the
engine with CUDA-graphed decode buckets gives the tokens of the eager engine (graphs off) for concurrent
mixed-length requests, with graphs replayed (and with the step compiled, --torch-compile)."""
from __future__ import annotations

import random

import pytest
import torch

from paratron.kernels.paged_attention import paged_attention, paged_attention_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("window,sinks", [(None, False), (127, False), (None, True), (31, True)])
def test_paged_kernel_matches_the_reference_in_bf16(window, sinks):
    """Plain causal, a sliding window, gpt-oss's sinks, both."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks, bs, g, qpg, d = 600, 64, 8, 4, 64
    k_pool, v_pool = (torch.randn(blocks, bs, g, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    tables = torch.randint(1, blocks, (32, 10), device="cuda", generator=gen)
    rows = torch.arange(32, device="cuda")
    lengths = torch.randint(1, 640, (32,), device="cuda", generator=gen)
    q = torch.randn(32, g, qpg, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(g * qpg, device="cuda", generator=gen) if sinks else None
    got = paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.125, window=window, sinks=sink)
    want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.125, window, sink)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.parametrize("width", [32, 2048])  # block-table widths: the automatic choice's cap, and the engine's
@pytest.mark.parametrize("window,sinks", [(None, False), (255, True)])
def test_split_context_kernel_matches_the_reference_at_batch_1(width, window, sinks):
    """The decode kernel's split-context path (flash-decoding) at batch 1 over 1,100 cached tokens, 8 groups x 4
    query heads: the automatic split count (more than one here) and forced ones, each the reference's output."""
    from paratron.kernels.paged_attention import _sms, decode_splits
    gen = torch.Generator(device="cuda").manual_seed(3)
    blocks, bs, g, qpg, d = 600, 64, 8, 4, 64
    k_pool, v_pool = (torch.randn(blocks, bs, g, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    tables = torch.randint(1, blocks, (1, width), device="cuda", generator=gen)
    rows, lengths = torch.zeros(1, dtype=torch.long, device="cuda"), torch.tensor([1100], device="cuda")
    q = torch.randn(1, g, qpg, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(g * qpg, device="cuda", generator=gen) if sinks else None
    assert decode_splits(g, width * bs, _sms(q.device)) > 1
    want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.125, window, sink)
    for splits in (0, 1, 2, 5, 18, 40):
        got = paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.125, window=window, sinks=sink,
                              splits=splits)
        assert torch.isfinite(got).all(), splits
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2, splits


def test_split_context_kernel_replays_in_a_cuda_graph_with_new_lengths():
    """The split count comes from the shapes alone: a graph captured at one context length replays the split
    kernels (their scratch from the graph's pool) for other lengths, each the reference's output."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    blocks, bs, g, qpg, d = 600, 64, 8, 4, 64
    k_pool, v_pool = (torch.randn(blocks, bs, g, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    tables = torch.randint(1, blocks, (2, 2048), device="cuda", generator=gen)
    rows, lengths = torch.tensor([1, 0], device="cuda"), torch.tensor([1100, 7], device="cuda")
    q = torch.randn(2, g, qpg, d, device="cuda", generator=gen).bfloat16()
    run = lambda: paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.125)  # noqa: E731
    run()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for new in ([1100, 7], [3, 2000], [640, 1]):
        lengths.copy_(torch.tensor(new))
        graph.replay()
        want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.125)
        assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 1e-2, new


@pytest.mark.parametrize("window,sinks", [(None, False), (100, True)])
def test_tiled_kernel_over_prompt_chunks_matches_the_reference_in_bf16(window, sinks):
    """The tiled form (prompt chunks: a tile of a request's consecutive tokens per program) on the GPU, with a mixed
    step's decodes beside the chunks (single-token tiles and a chunk of 3: the narrow launch)."""
    from paratron.kernels.paged_attention import tiles_of
    gen = torch.Generator(device="cuda").manual_seed(1)
    blocks, bs, g, qpg, d = 600, 64, 8, 4, 64
    k_pool, v_pool = (torch.randn(blocks, bs, g, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    chunks, cached = [300, 1, 77, 512, 1, 1, 3, 1], [0, 400, 200, 0, 700, 50, 20, 300]
    tables = torch.randint(1, blocks, (len(chunks), 12), device="cuda", generator=gen)
    rows = torch.cat([torch.full((n,), r) for r, n in enumerate(chunks)]).cuda()
    lengths = torch.cat([torch.arange(c + 1, c + n + 1) for c, n in zip(cached, chunks)]).cuda()
    q = torch.randn(len(rows), g, qpg, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(g * qpg, device="cuda", generator=gen) if sinks else None
    tiles = torch.tensor(tiles_of(chunks, qpg), device="cuda")
    got = paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.125, window=window, sinks=sink, tiles=tiles)
    want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.125, window, sink)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.parametrize("compile", [False, True])
def test_graphed_decode_gives_the_eager_tokens(compile):
    from paratron.config.inference import InferenceConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.paged import PagedEngine
    from paratron.inference.sampling import SamplingParams
    from tests.unit.test_generate import VOCAB, tiny_model
    engine = Engine(tiny_model().cuda(), VOCAB, compile=compile)
    rng = random.Random(0)
    reqs = [Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))],
                    SamplingParams(max_new_tokens=rng.randint(4, 20))) for _ in range(24)]
    base = dict(inference_dynamic_batching_block_size=16, inference_dynamic_batching_max_tokens=64,
                enable_chunked_prefill=True, inference_dynamic_batching_num_blocks=200)
    graphed = PagedEngine(engine, InferenceConfig(**base))
    eager = PagedEngine(engine, InferenceConfig(**base, inference_dynamic_batching_num_cuda_graphs=0))
    got, want = graphed.generate(reqs), eager.generate(reqs)
    assert graphed.graphs is not None and graphed.graphs.graphs  # some bucket was captured and replayed
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_warm_up_captures_every_bucket_in_two_compilations():
    """warm_up compiles and captures every bucket before any request: batch 1 and one symbolic batch size for
    the larger buckets (a compilation per bucket would count one graph per bucket), and the graphs it captured
    give the eager engine's tokens."""
    from torch._dynamo.utils import counters
    from paratron.config.inference import InferenceConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.paged import PagedEngine
    from paratron.inference.sampling import SamplingParams
    from tests.unit.test_generate import VOCAB, tiny_model
    engine = Engine(tiny_model().cuda(), VOCAB, compile=True)
    base = dict(inference_dynamic_batching_block_size=16, inference_dynamic_batching_num_blocks=400,
                inference_dynamic_batching_max_requests=64)
    paged = PagedEngine(engine, InferenceConfig(**base))
    torch._dynamo.reset()
    counters.clear()
    paged.warm_up()
    assert sorted(paged.graphs.graphs) == paged.graphs.sizes == [1, 2, 4, 8, 16, 32, 64]
    assert counters["stats"]["unique_graphs"] < len(paged.graphs.sizes), dict(counters["stats"])
    rng = random.Random(1)
    reqs = [Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_new_tokens=rng.randint(2, 24))) for _ in range(40)]
    eager = PagedEngine(engine, InferenceConfig(**base, inference_dynamic_batching_num_cuda_graphs=0))
    assert [r.tokens for r in paged.generate(reqs)] == [r.tokens for r in eager.generate(reqs)]


@pytest.mark.parametrize("compile", [False, True])
def test_async_steps_give_the_plain_tokens_through_graphs_and_compiled_steps(compile):
    """--inference-dynamic-batching-async-sched-mode async on a GPU: pinned copies, events, placeholders written into the
    graphed and compiled steps' ids on the device; the same tokens as the plain engine, nothing left in flight."""
    from paratron.config.inference import InferenceConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.paged import PagedEngine
    from paratron.inference.paged_async import AsyncPagedEngine
    from paratron.inference.sampling import SamplingParams
    from tests.unit.test_generate import VOCAB, tiny_model
    engine = Engine(tiny_model().cuda(), VOCAB, compile=compile)
    rng = random.Random(2)
    reqs = [Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_new_tokens=rng.randint(2, 24), temperature=0.0 if i % 3 else 0.8, seed=i))
            for i in range(40)]
    base = dict(inference_dynamic_batching_block_size=16, inference_dynamic_batching_max_tokens=64,
                enable_chunked_prefill=True, inference_dynamic_batching_num_blocks=300)
    fast = AsyncPagedEngine(engine, InferenceConfig(**base, inference_dynamic_batching_async_sched_mode="async"))
    fast.warm_up()
    got = fast.generate(reqs)
    want = PagedEngine(engine, InferenceConfig(**base)).generate(reqs)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert fast.inflight is None and fast.blocks.used == 0


def test_compiled_decode_writes_the_pool_in_place():
    """A compiled graphed decode step over a pool of 100,000 blocks allocates nothing near the pool's size: the
    keys and values go into the pool where it lies (kernels/paged_attention.paged_store), not into a copy of it."""
    from paratron.config.inference import InferenceConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.paged import PagedEngine
    from paratron.inference.sampling import SamplingParams
    from tests.unit.test_generate import VOCAB, tiny_model
    engine = Engine(tiny_model().cuda(), VOCAB, compile=True)
    paged = PagedEngine(engine, InferenceConfig(inference_dynamic_batching_block_size=16,
                                                inference_dynamic_batching_num_blocks=100_000))
    pool = paged.cache.layer(0)[0]
    pool_bytes = pool.numel() * pool.element_size()
    reqs = [Request([1 + i, 2, 3], SamplingParams(max_new_tokens=12)) for i in range(8)]
    paged.generate(reqs[:2])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    paged.generate(reqs)
    torch.cuda.synchronize()
    assert paged.graphs is not None and paged.graphs.graphs
    assert torch.cuda.max_memory_allocated() - before < pool_bytes / 2, (torch.cuda.max_memory_allocated(), before)


def _models_on_cuda(kind: str):
    """(model on CUDA, vocabulary) of each kind the paged engine serves beside grouped-query attention."""
    if kind == "windows":
        from tests.unit.test_attention_variants import _model
        return _model(window_size="3,0", window_attn_skip_freq="2", softmax_type="learnable").cuda(), 100
    if kind == "hybrid":
        from tests.unit.test_hybrid_generate import VOCAB, model
        return model().cuda(), VOCAB
    import tempfile
    from pathlib import Path
    from paratron.inference.load import load_for_inference
    from tests.unit.test_mla_generation import deepseek_model
    d = Path(tempfile.mkdtemp())
    deepseek_model().save_pretrained(d / "hf")
    loaded = load_for_inference(d / "hf", device=torch.device("cuda"))
    return loaded.model, loaded.vocab_size


@pytest.mark.parametrize("kind", ["windows", "hybrid", "mla"])
def test_windows_recurrent_and_latent_models_equal_the_fixed_engine(kind):
    """gpt-oss's windows and sinks (the kernel's window start and sink), a hybrid stack's state rows and multi-latent
    attention's latent rows through the paged engine on CUDA: the fixed-batch engine's greedy tokens."""
    from paratron.config.inference import InferenceConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.paged import PagedEngine
    from paratron.inference.sampling import SamplingParams
    model, vocab = _models_on_cuda(kind)
    engine = Engine(model, vocab)
    reqs = [Request(p, SamplingParams(max_new_tokens=6)) for p in ([5, 6, 7, 8, 9, 10, 11], [11, 12], [3, 40, 41])]
    paged = PagedEngine(engine, InferenceConfig(inference_dynamic_batching_block_size=4,
                                                inference_dynamic_batching_max_tokens=8, enable_chunked_prefill=True,
                                                inference_dynamic_batching_num_blocks=40))
    assert [r.tokens for r in paged.generate(reqs)] == [engine.generate([r])[0].tokens for r in reqs]


@pytest.mark.parametrize("async_mode", ["legacy", "async"])
def test_mixed_step_graphs_give_the_compiled_steps_tokens(async_mode):
    """--inference-dynamic-batching-cuda-graph-mixed-prefill-count: warm_up captures every token bucket; steps with
    prompt chunks replay them (prefix-cache hits among them) and the tokens equal the engine's without them."""
    from paratron.config.inference import InferenceConfig
    from paratron.inference.engine import Engine, Request
    from paratron.inference.paged_spec import build_paged
    from paratron.inference.sampling import SamplingParams
    from tests.unit.test_generate import VOCAB, tiny_model
    engine = Engine(tiny_model().cuda(), VOCAB, compile=True)
    rng = random.Random(2)
    shared = [rng.randrange(1, VOCAB) for _ in range(32)]  # + up to 16 own + 16 new: within the context of 64
    reqs = [Request(shared + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 16))],
                    SamplingParams(max_new_tokens=rng.randint(2, 16))) for _ in range(24)]
    base = dict(inference_dynamic_batching_block_size=16, inference_dynamic_batching_max_tokens=256,
                enable_chunked_prefill=True, inference_dynamic_batching_num_blocks=400,
                inference_dynamic_batching_prefix_caching=True, inference_dynamic_batching_async_sched_mode=async_mode)
    plain = build_paged(engine, InferenceConfig(**base))
    want = plain.generate(reqs)
    graphed = build_paged(engine, InferenceConfig(**base, inference_dynamic_batching_cuda_graph_mixed_prefill_count=8))
    graphed.warm_up()
    mixed = graphed.mixed.graphs
    assert sorted(mixed.graphs) == mixed.sizes == [64, 128, 256, 257]
    assert [r.tokens for r in graphed.generate(reqs)] == [r.tokens for r in want]
    assert mixed.runs > len(mixed.sizes) * 3  # (warm-up: two eager calls and a capture per bucket)


def test_step_inputs_reach_the_gpu_without_waiting_for_its_queue():
    """The last-token rows of a step with partial prompt chunks and a sampled batch's parameters are copied from
    pinned memory: a plain host copy makes torch wait for the work queued on the device (the running step), which
    took away the overlap of asynchronous steps."""
    from types import SimpleNamespace
    from paratron.config.inference import InferenceConfig
    from paratron.inference.engine import Engine
    from paratron.inference.paged import PagedEngine
    from paratron.inference.sampling import Sampler, SamplingParams
    from tests.unit.test_generate import VOCAB, tiny_model
    paged = PagedEngine(Engine(tiny_model().cuda(), VOCAB), InferenceConfig(inference_dynamic_batching_num_blocks=64))
    logits = torch.randn(6, VOCAB, device="cuda")
    torch.cuda._sleep(10_000_000)  # work in the queue while the copies are made
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = paged._last_logits([SimpleNamespace(id=0), SimpleNamespace(id=2)], logits, {0: [1], 1: [2], 2: [4]})
        sampler = Sampler([SamplingParams(temperature=0.7, top_k=5), SamplingParams()], "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(rows, logits[[1, 4]]) and sampler.top_k[:, 0].tolist() == [5, 0]

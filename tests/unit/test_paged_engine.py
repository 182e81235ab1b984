"""The paged engine (paratron/inference/paged.py) on a tiny Llama on CPU: 64 concurrent requests of mixed lengths
give each one's alone result; prefix-cache hits give the tokens of misses; a tiny block pool preempts and
recomputes without losing a request or changing an output; seeded sampling and log-probabilities equal the
fixed-batch engine's; GPT-2 style and MoE models too; the block allocator's reference counts and eviction; the paged
attention's reference against dense attention (its Triton kernel against the reference: tests/unit/test_kernels.py);
the CUDA-graph path's padded inputs."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from paratron.config.inference import InferenceConfig  # noqa: E402
from paratron.inference.blocks import BlockAllocator, chain_keys  # noqa: E402
from paratron.inference.engine import Engine, Request  # noqa: E402
from paratron.inference.paged import PagedEngine  # noqa: E402
from paratron.inference.sampling import SamplingParams  # noqa: E402
from tests.unit.test_generate import VOCAB, tiny_model  # noqa: E402
from tests.threads import one_thread  # noqa: F401  (autouse: one intra-op thread)


def config(**kw) -> InferenceConfig:
    base = dict(inference_dynamic_batching_block_size=4, inference_dynamic_batching_max_tokens=32,
                enable_chunked_prefill=True, inference_dynamic_batching_max_requests=16)
    return InferenceConfig(**{"inference_dynamic_batching_" + k if not k.startswith(("enable", "infer")) else k: v
                              for k, v in {**base, **kw}.items()})


def mixed(n: int, seed: int, longest: int = 20) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, longest))],
                    SamplingParams(max_new_tokens=rng.randint(1, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model(), VOCAB)


def test_64_concurrent_mixed_requests_equal_each_alone(engine):
    reqs = mixed(64, 0)
    paged = PagedEngine(engine, config())
    together = paged.generate(reqs)
    assert paged.steps < 64 and paged.stats()["kv_blocks_used"] == 0  # batched; every block given back
    alone = [paged.generate([r])[0] for r in reqs]
    for r, got, want in zip(reqs, together, alone):
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason, r.prompt
    for r, got in zip(reqs[:8], together):  # and the fixed-batch engine's
        assert got.tokens == engine.generate([r])[0].tokens


def test_paged_engine_keeps_torch_gemms_unless_cublaslt_is_on():
    """--kernel-cublaslt auto: the paged engine turns the linear layers to torch's calls (cuBLASLt's timed choice
    would time every new row count of a step carrying prompt chunks, inside the step); on: kept, and said."""
    from paratron.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    for choice, want in (("auto", False), ("on", True)):
        model = tiny_model()
        model.kernels.kernel_cublaslt = choice
        paged = PagedEngine(Engine(model, VOCAB), config())
        flags = {m.cublaslt for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
        assert flags == {want} and paged.cublaslt is want
        assert paged.startup_line().endswith("GEMMs: cuBLASLt timed choice" if want else "GEMMs: torch")


def tiny_moe():
    from paratron.config import ModelConfig
    from paratron.model.gpt import GPTModel
    from tests.unit.test_generate import sharpen
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                    hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", swiglu=True,
                    position_embedding_type="rope", group_query_attention=True, num_query_groups=2,
                    disable_bias_linear=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    torch.manual_seed(0)
    model = GPTModel(m.resolved(), 128, seed=3).eval()
    sharpen(model, 1)
    return model


@pytest.mark.parametrize("style", ["gpt", "moe"])
def test_learned_positions_plain_heads_and_experts_too(style):
    """GPT-2 style (learned absolute positions, a key/value head per query head) and a mixture of experts through
    the paged engine: each request's tokens alone."""
    other = Engine(tiny_model("gpt") if style == "gpt" else tiny_moe(), VOCAB)
    reqs = mixed(12, 5)
    got = PagedEngine(other, config(max_tokens=16)).generate(reqs)
    assert [g.tokens for g in got] == [other.generate([r])[0].tokens for r in reqs]


@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_prefix_cache_hits_give_the_tokens_of_misses(engine, policy):
    rng = random.Random(1)
    shared = [rng.randrange(1, VOCAB) for _ in range(17)]
    reqs = [Request(shared + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))],
                    SamplingParams(max_new_tokens=8)) for _ in range(6)]
    cached = PagedEngine(engine, config(prefix_caching=True, prefix_caching_eviction_policy=policy))
    if policy == "lru":  # one after another: the blocks of the first stay cached after it ends
        got = [cached.generate([r])[0] for r in reqs]
    else:  # ref_zero: shared while running together only
        got = cached.generate(reqs)
    hits = cached.stats()["prefix_cache_hit_blocks"]
    assert hits == 4 * (len(reqs) - 1) if policy == "lru" else hits >= 8  # (ref_zero: those admitted later)
    plain = PagedEngine(engine, config()).generate(reqs)
    assert [g.tokens for g in got] == [p.tokens for p in plain]


@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_requests_arriving_one_by_one_reuse_a_shared_prefix_and_stats_count_from_the_reset(engine, policy):
    """benchmarks/serve_load.py's offline arrivals: a warm-up of requests admitted together (none shares: their
    blocks are registered after the step that computes them), reset_stats, then requests one at a time. One that
    arrives while another holding the prefix runs computes its suffix only; one that arrives after they all
    finished does too under lru, and computes it all again under ref_zero. The peak and the hits are the timed
    run's, not the warm-up's (the warm-up's peak stood for the run's: the same peak KV bytes with and without
    caching)."""
    rng = random.Random(7)
    shared = [rng.randrange(1, VOCAB) for _ in range(16)]  # 4 full blocks of 4
    prompt = lambda: shared + [rng.randrange(1, VOCAB) for _ in range(2)]  # noqa: E731
    paged = PagedEngine(engine, config(max_tokens=64, prefix_caching=True, prefix_caching_eviction_policy=policy))
    warm = paged.generate([Request(prompt(), SamplingParams(max_new_tokens=6)) for _ in range(3)])
    assert paged.stats()["prefix_cache_hit_blocks"] == 0 and paged.stats()["kv_blocks_peak"] == 3 * 6
    paged.reset_stats()
    assert paged.stats()["kv_blocks_peak"] == 0 and paged.stats()["prefix_cache_hit_blocks"] == 0
    plans, schedule = [], paged.sched.schedule
    paged.sched.schedule = lambda: plans.append(schedule()) or plans[-1]
    reqs = [Request(prompt(), SamplingParams(max_new_tokens=6)) for _ in range(3)]

    def computed_at_admission(seq):
        return next(n for s, n in plans[-1] if s is seq)
    a = paged.add(reqs[0])  # the warm-up's blocks: kept by lru, forgotten by ref_zero
    paged.step()
    assert computed_at_admission(a) == (2 if policy == "lru" else 18)
    b = paged.add(reqs[1])  # while a runs
    paged.step()
    assert computed_at_admission(b) == 2  # its suffix only
    while not paged.idle:
        paged.step()
    c = paged.add(reqs[2])  # after a and b finished
    paged.step()
    assert computed_at_admission(c) == (2 if policy == "lru" else 18)
    while not paged.idle:
        paged.step()
    hits = paged.stats()["prefix_cache_hit_blocks"]
    assert hits == (12 if policy == "lru" else 4)
    assert paged.stats()["kv_blocks_peak"] == 6 + 2  # a's 6 blocks and b's own 2 (the 4 of the prefix shared)
    plain = PagedEngine(engine, config())
    assert [paged.result(s).tokens for s in (a, b, c)] == [r.tokens for r in plain.generate(reqs)]
    assert [w.tokens for w in warm] == [r.tokens for r in plain.generate(
        [Request(list(w.prompt), SamplingParams(max_new_tokens=6)) for w in warm])]


@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_under_a_tiny_pool_loses_nothing_and_changes_nothing(engine, chunked):
    reqs = mixed(16, 10)
    for r in reqs:  # without chunked prefill, preempted requests hold more tokens than a step (20) takes
        r.params.max_new_tokens = 8 if chunked else 25
    blocks = 9 if chunked else 14
    paged = PagedEngine(engine, config(num_blocks=blocks, max_tokens=20, enable_chunked_prefill=chunked,
                                       prefix_caching=True, prefix_caching_eviction_policy="lru"))
    got = paged.generate(reqs)
    assert paged.stats()["preemptions"] > 0 and paged.stats()["kv_blocks_peak"] == blocks - 1
    assert [g.tokens for g in got] == [engine.generate([r])[0].tokens for r in reqs]


def test_seeded_sampling_and_logprobs_equal_the_fixed_batch_engine(engine):
    reqs = mixed(6, 3)
    reqs[1].params = SamplingParams(max_new_tokens=9, logprobs=True, top_logprobs=2)
    reqs[2].params = SamplingParams(max_new_tokens=7, temperature=1.0, top_k=20, seed=5)
    reqs[3].params = SamplingParams(max_new_tokens=0)
    reqs[4].params = SamplingParams(max_new_tokens=5, stop=(), ignore_eod=True, logprobs=True)
    got = PagedEngine(engine, config(max_tokens=6)).generate(reqs)
    for r, res in zip(reqs, got):
        want = engine.generate([r])[0]
        assert res.tokens == want.tokens and res.finish_reason == want.finish_reason
        if r.params.logprobs:
            assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(want.logprobs), atol=1e-5)
            assert torch.allclose(torch.tensor(res.prompt_logprobs[1:]), torch.tensor(want.prompt_logprobs[1:]),
                                  atol=1e-5)
    assert [[t for t, _ in s] for s in got[1].top_logprobs] == [[t for t, _ in s] for s in
                                                                engine.generate([reqs[1]])[0].top_logprobs]
    assert got[3].tokens == []


def test_requests_the_pool_or_a_step_cannot_hold_are_refused(engine):
    small = PagedEngine(engine, config(num_blocks=3, enable_chunked_prefill=False, max_tokens=8))
    assert "KV blocks" in small.check(Request([1] * 5, SamplingParams(max_new_tokens=8)))
    assert "--enable-chunked-prefill" in small.check(Request([1] * 9, SamplingParams(max_new_tokens=1)))
    assert small.check(Request([1] * 4, SamplingParams(max_new_tokens=4))) is None


def test_block_allocator_counts_references_and_evicts_least_recently_released():
    a = BlockAllocator(5, 2, prefix_caching=True, policy="lru")
    x, y = a.allocate(2), a.allocate(2)
    assert sorted(x + y) == [1, 2, 3, 4] and a.allocate(1) is None  # block 0 is the scratch block
    kx, ky = chain_keys([1, 2, 3, 4], 2, 2), chain_keys([9, 9, 9, 9], 2, 2)
    assert kx[1] != chain_keys([0, 0, 3, 4], 2, 2)[1]  # a key holds the whole prefix, not just its block
    for b, k in zip(x + y, kx + ky):
        a.register(b, k)
    a.release(x)
    a.release(y)
    assert a.available == 4 and a.lookup(kx) == x  # x cached, found again (a reference each)
    assert a.allocate(2) == y  # the evictable blocks go least recently released first
    assert a.lookup(ky) == []  # ... and forgot their keys
    z = BlockAllocator(3, 2, prefix_caching=True, policy="ref_zero")
    b = z.allocate(1)
    z.register(b[0], kx[0])
    assert z.lookup(kx[:1]) == b and z.refs[b[0]] == 2
    z.release(b + b)
    assert z.lookup(kx[:1]) == [] and z.available == 2  # ref_zero: forgotten at the last release


def test_paged_attention_reference_equals_dense_attention():
    from paratron.kernels.decode_attention import masked_attention
    from paratron.kernels.paged_attention import paged_attention_reference
    torch.manual_seed(0)
    bs, g, qpg, d, blocks = 3, 2, 2, 8, 9
    k_pool, v_pool = torch.randn(2, blocks, bs, g, d)
    tables = torch.tensor([[4, 1, 7, 0], [2, 8, 0, 0]])
    rows, lengths = torch.tensor([0, 0, 1, 0]), torch.tensor([10, 3, 5, 7])
    q = torch.randn(4, g, qpg, d)
    got = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.3)
    for i in range(4):
        t = tables[rows[i]]
        keys = k_pool[t].reshape(-1, g, d)[:lengths[i]].transpose(0, 1)
        vals = v_pool[t].reshape(-1, g, d)[:lengths[i]].transpose(0, 1)
        want = masked_attention(q[i], keys, vals, torch.ones(1, dtype=torch.bool), 0.3)
        assert torch.allclose(got[i], want, atol=1e-5)


def test_decode_graph_inputs_padded_to_a_bucket_give_the_eager_logits(engine):
    """The CUDA-graph path's host side on CPU (the graphs themselves: tests/gpu/test_paged_cuda.py): a decode step
    padded to its bucket (padding rows in the scratch block, full-width tables) gives the eager step's logits."""
    from paratron.inference.paged_graphs import DecodeGraphs, buckets
    assert buckets(256, 16) == [1, 2, 4, 8, 16, 32, 64, 128, 256] and buckets(6, 3) == [1, 2, 4]
    paged = PagedEngine(engine, config(max_tokens=64))
    for r in mixed(5, 7):
        paged.add(r)
    paged.step()
    while paged.sched.waiting or any(s.need > 1 for s in paged.sched.running):  # until every request decodes
        paged.step()
    plan = paged.sched.schedule()
    assert len(plan) >= 3 and all(n == 1 for _, n in plan)
    with torch.no_grad():
        want, _ = paged._run(plan)  # (writes the step's keys and values; the padded step writes the same)
    graphs = DecodeGraphs(paged, 4)
    bs = paged.block_size
    pos = [s.computed for s, _ in plan]
    graphs._fill(8, [s.tokens[p] for (s, _), p in zip(plan, pos)], pos,
                 [s.blocks[p // bs] * bs + p % bs for (s, _), p in zip(plan, pos)],
                 paged.tables.rows_for([s for s, _ in plan]), [p + 1 for p in pos])
    with torch.no_grad():
        got = graphs._step(8)
    assert got.shape[0] == 8 and torch.allclose(got[:len(plan)], want, atol=1e-5)


def test_requests_compare_by_identity():
    """Two requests with equal fields are two requests: the scheduler's membership tests and removals stay
    identity checks (field-wise equality made each step's scheduling quadratic in the running requests)."""
    from paratron.inference.scheduler import Seq
    a, b = Seq(1, None, 4, tokens=[5, 6]), Seq(1, None, 4, tokens=[5, 6])
    assert a != b and a == a and len({a, b}) == 2


def test_stats_report_the_step_time_and_the_wait_for_the_device(engine):
    paged = PagedEngine(engine, InferenceConfig(inference_dynamic_batching_block_size=4,
                                                inference_dynamic_batching_num_blocks=100))
    assert paged.stats()["step_ms_mean"] == 0.0
    paged.generate([Request([1 + i, 2, 3], SamplingParams(max_new_tokens=5)) for i in range(3)])
    s = paged.stats()
    assert s["steps"] >= 5 and s["step_ms_mean"] > 0
    assert 0 <= s["device_wait_ms_mean"] <= s["step_ms_mean"]
    assert 0 < s["decode_steps"] < s["steps"] and s["decode_step_ms_mean"] > 0 and s["mixed_step_ms_mean"] > 0

"""--inference-dynamic-batching-async-sched-mode async (inference/paged_async.py): step n+1 scheduled and launched before step
n's tokens are read back, its placeholders filled on the device; the outputs equal the plain paged engine's."""
from __future__ import annotations

import pytest

from paratron.errors import ConfigError
from paratron.inference.engine import Engine, Request
from paratron.inference.paged import PagedEngine
from paratron.inference.paged_async import PLACEHOLDER, AsyncPagedEngine
from paratron.inference.sampling import SamplingParams
from tests.threads import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.unit.test_generate import VOCAB, tiny_model
from tests.unit.test_paged_engine import config, mixed


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model(), VOCAB)


def both(engine, reqs, **kw):
    """(plain results, async results, the async engine) of ``reqs`` on the same config."""
    plain = PagedEngine(engine, config(**kw)).generate(reqs)
    fast = AsyncPagedEngine(engine, config(**kw, async_sched_mode="async"))
    return plain, fast.generate(reqs), fast


def test_64_concurrent_mixed_requests_equal_the_plain_engine_and_leak_nothing(engine):
    reqs = mixed(64, 0, longest=30)
    plain, got, fast = both(engine, reqs, max_tokens=40, max_requests=24)
    assert [g.tokens for g in got] == [p.tokens for p in plain]
    assert [g.finish_reason for g in got] == [p.finish_reason for p in plain]
    assert fast.blocks.used == 0 and fast.inflight is None and fast.idle
    assert all(PLACEHOLDER not in s.tokens for s in fast.sched.running)


@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_and_prefix_caching_under_a_tiny_pool_change_nothing(engine, chunked):
    reqs = mixed(12, 2)
    for r in reqs:
        r.params.max_new_tokens = 8 if chunked else 25
    blocks = 9 if chunked else 14
    plain, got, fast = both(engine, reqs, num_blocks=blocks, max_tokens=20, enable_chunked_prefill=chunked,
                            prefix_caching=True, prefix_caching_eviction_policy="lru")
    assert fast.stats()["preemptions"] > 0
    assert [g.tokens for g in got] == [p.tokens for p in plain]


def test_stops_seeded_sampling_and_logprobs_equal_the_plain_engine(engine):
    stop_at = engine.generate([Request([5, 6, 7], SamplingParams(max_new_tokens=6))])[0].tokens[2]
    e = Engine(engine.model, VOCAB, eod=stop_at)  # an end-of-document token that the model does produce
    reqs = mixed(10, 4)
    for i, r in enumerate(reqs):
        r.params = SamplingParams(max_new_tokens=9, temperature=0.9 if i % 2 else 0.0, seed=i)
    reqs.append(Request([5, 6, 7], SamplingParams(max_new_tokens=6)))  # stops at its third token
    plain, got, _ = both(e, reqs, max_tokens=12)
    assert [g.tokens for g in got] == [p.tokens for p in plain] and got[-1].finish_reason == "stop"
    reqs[3].params = SamplingParams(max_new_tokens=5, logprobs=True)  # its steps run synchronously
    plain, got, fast = both(e, reqs, max_tokens=12)
    assert [g.tokens for g in got] == [p.tokens for p in plain]
    assert got[3].logprobs == pytest.approx(plain[3].logprobs, abs=1e-5) and fast.wanting_logprobs == 0


def test_each_token_is_streamed_once_a_step_late(engine):
    reqs = mixed(8, 5)
    fast = AsyncPagedEngine(engine, config(max_tokens=16, async_sched_mode="async"))
    seen: dict = {}
    got = fast.generate(reqs, lambda seq, t: seen.setdefault(seq.id, []).append(t))
    streamed = [[t for t in seen[i] if t is not None] for i in sorted(seen)]
    assert streamed == [g.tokens for g in got]


def test_refused_with_speculative_decoding():
    e = Engine(tiny_model(), VOCAB)
    e.num_speculative_tokens = 1
    with pytest.raises(ConfigError, match="async-sched-mode async: not with speculative decoding"):
        AsyncPagedEngine(e, config(async_sched_mode="async"))


def test_builder_picks_it_from_the_config(engine):
    from paratron.inference.paged_spec import build_paged
    assert type(build_paged(engine, config(async_sched_mode="async"))) is AsyncPagedEngine
    assert type(build_paged(engine, config())) is PagedEngine


def test_async_sched_mode_takes_megatrons_values_only():
    """Megatron's flag and values (legacy, async); another value is one line naming the choices."""
    from paratron.config.inference import check_inference
    with pytest.raises(ConfigError, match="async-sched-mode serial: choose one of legacy, async"):
        check_inference(config(async_sched_mode="serial"))
    check_inference(config(async_sched_mode="async"))

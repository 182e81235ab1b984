"""Speculative decoding in the paged engine (paratron/inference/paged_spec.py): greedy tokens and log-probabilities of
24 concurrent mixed requests under a tiny token budget and block pool (chunked prefill, preemption, prefix caching)
equal plain paged decoding's and the fixed-batch engine's, with drafts almost always rejected (random MTP depths)
and mostly accepted (depths that predict as the model does); every block is given back; sampled tokens follow the
target distribution (the joint of the first two tokens against the model's, over many requests), their
log-probabilities are the model's; streaming callbacks and stop conditions as without drafts; refusals by name."""
from __future__ import annotations

import collections
import random

import pytest
import torch

from paratron.config import ConfigError
from paratron.config.inference import InferenceConfig
from paratron.inference.engine import Engine, Request
from paratron.inference.paged import PagedEngine
from paratron.inference.paged_spec import SpeculativePagedEngine, build_paged
from paratron.inference.sampling import SamplingParams
from tests.unit.test_generate import VOCAB
from tests.unit.test_speculative import bigram_drafter, mtp_model
from tests.threads import one_thread  # noqa: F401  (autouse: one intra-op thread)


def config(**kw) -> InferenceConfig:
    base = dict(block_size=4, max_tokens=10, max_requests=16, num_blocks=10)
    return InferenceConfig(enable_chunked_prefill=kw.pop("chunked", True),
                           **{"inference_dynamic_batching_" + k: v for k, v in {**base, **kw}.items()})


def mixed(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 18))],
                    SamplingParams(max_new_tokens=rng.randint(1, 14), logprobs=i % 3 == 0, top_logprobs=i % 2))
            for i in range(n)]


@pytest.fixture(scope="module")
def models():
    return {"rejected": mtp_model(), "accepted": bigram_drafter(mtp_model(layers=1), attention=0.3, noise=0.7)}


def no_leak(paged) -> None:
    b = paged.blocks
    assert paged.stats()["kv_blocks_used"] == 0 and not any(b.refs) and paged.idle and not paged.windows
    assert sorted(list(b.free) + list(b.evictable)) == list(range(1, paged.num_blocks))


@pytest.mark.parametrize("case", ["rejected", "accepted"])
def test_greedy_equals_plain_paged_and_fixed_batch(models, case):
    model = models[case]
    reqs = mixed(24, 1)
    plain = PagedEngine(Engine(model, VOCAB), config()).generate(reqs)
    fixed = Engine(model, VOCAB)
    for i in (0, 3, 7):
        assert fixed.generate([reqs[i]])[0].tokens == plain[i].tokens
    preempted = 0
    for k, kw in ((1, {}), (2, dict(prefix_caching=True, prefix_caching_eviction_policy="lru")),
                  (2, dict(chunked=False, max_tokens=20, num_blocks=12))):
        paged = build_paged(Engine(model, VOCAB, num_speculative_tokens=k), config(**kw))
        got = paged.generate(reqs)
        for r, g, p in zip(reqs, got, plain):
            assert (g.tokens, g.finish_reason) == (p.tokens, p.finish_reason), r.prompt
            if r.params.logprobs:
                assert g.logprobs == pytest.approx(p.logprobs, abs=1e-5)
                assert g.prompt_logprobs[1:] == pytest.approx(p.prompt_logprobs[1:], abs=1e-5)
                if r.params.top_logprobs:
                    assert [[t for t, _ in s] for s in g.top_logprobs] == [[t for t, _ in s] for s in p.top_logprobs]
        stats = paged.stats()
        assert stats["speculative_drafted"] > 20, stats
        if case == "rejected":
            assert stats["speculative_acceptance_rate"] < 0.2, stats
        else:
            assert stats["speculative_acceptance_rate"] > 0.6 and stats["speculative_tokens_per_step"] > 1.5, stats
        preempted += stats["preemptions"]
        no_leak(paged)
    assert preempted > 0


def test_sampled_tokens_follow_the_target_distribution(models):
    """3000 copies of one prompt, temperature 6 among the top 3, one draft per step: the joint of the first two
    tokens (the second through drafts accepted or rejected) is the model's (total variation 0.01 here; 0.12 when
    every draft is accepted); log-probabilities are the model's (at temperature 1, as without drafts)."""
    model, temperature = models["accepted"], 6.0
    prompt, n = [5, 9, 17, 4], 3000
    torch.manual_seed(0)
    fixed = Engine(model, VOCAB)
    look = SamplingParams(max_new_tokens=1, logprobs=True, top_logprobs=3)

    def top3(tokens):
        (pairs,) = fixed.generate([Request(tokens, look)])[0].top_logprobs
        weights = (torch.tensor([lp for _, lp in pairs]) / temperature).exp()
        return {t: float(w) for (t, _), w in zip(pairs, weights / weights.sum())}
    first = top3(prompt)
    target = {(a, b): pa * pb for a, pa in first.items() for b, pb in top3(prompt + [a]).items()}
    paged = build_paged(Engine(model, VOCAB, num_speculative_tokens=1),
                        config(max_tokens=4096, max_requests=n, num_blocks=2 * n + 1))
    params = SamplingParams(max_new_tokens=3, temperature=temperature, top_k=3, logprobs=True, ignore_eod=True)
    got = paged.generate([Request(prompt, params) for _ in range(n)])
    counts = collections.Counter(tuple(g.tokens[:2]) for g in got)
    assert set(counts) <= set(target)
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in target.items())
    assert tv < 0.04, (tv, counts, target)
    rate = paged.stats()["speculative_acceptance_rate"]
    assert 0.1 < rate < 0.95, rate  # both paths of the rule taken
    for g in got[:3]:
        want = fixed.generate([Request(prompt + g.tokens, SamplingParams(max_new_tokens=0, logprobs=True))])[0]
        assert g.logprobs == pytest.approx(want.prompt_logprobs[len(prompt):], abs=1e-5)
    no_leak(paged)


def test_seeded_streaming_and_stops_as_without_drafts():
    model = bigram_drafter(mtp_model(layers=1), attention=3.0, noise=0.3)  # drafts mostly right, tokens change
    prompt = [5, 6, 7, 8, 9, 10, 11]
    greedy = Engine(model, VOCAB).generate([Request(prompt, SamplingParams(max_new_tokens=12))])[0].tokens
    new = [i for i, t in enumerate(greedy) if t not in greedy[:i]]  # where a token first appears
    assert len(new) >= 3, greedy
    eod, stop = greedy[new[2]], greedy[new[1]]
    detok = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    reqs = [Request(prompt, SamplingParams(max_new_tokens=12)),
            Request(prompt, SamplingParams(max_new_tokens=12, stop=(f"<{stop}>",))),
            Request(prompt, SamplingParams(max_new_tokens=9, temperature=0.8, seed=4)),
            Request([7, 1], SamplingParams(max_new_tokens=0, logprobs=True))]
    plain = PagedEngine(Engine(model, VOCAB, eod=eod, detokenize=detok), config()).generate(reqs)
    runs = []
    for _ in range(2):
        paged = build_paged(Engine(model, VOCAB, eod=eod, detokenize=detok, num_speculative_tokens=2),
                            config())
        streamed = collections.defaultdict(list)
        got = paged.generate(reqs, lambda seq, t: streamed[seq.id].append(t))
        assert [[t for t in streamed[i] if t is not None] for i in range(len(reqs))] == [g.tokens for g in got]
        runs.append(got)
        no_leak(paged)
    for g, p in zip(runs[0][:2] + runs[0][3:], plain[:2] + plain[3:]):
        assert (g.tokens, g.finish_reason, g.text) == (p.tokens, p.finish_reason, p.text)
    for g in runs[0][:2]:  # the end-of-document token, the stop string: before max_new_tokens
        assert g.finish_reason == "stop" and len(g.tokens) < 12
    assert runs[0][0].tokens == greedy[:new[2]] and paged.stats()["speculative_accepted"] > 4
    assert runs[0][2].tokens == runs[1][2].tokens and 0 < len(runs[0][2].tokens) <= 9  # seeded: reproducible


def test_refused_by_name_and_reported():
    from tests.unit.test_hybrid_generate import model as hybrid_model
    engine = Engine(hybrid_model(), 64)
    engine.num_speculative_tokens = 1  # (the checks of --mtp-num-layers refuse MTP for hybrid stacks anyway)
    with pytest.raises(ConfigError, match="cannot roll back rejected drafts"):
        build_paged(engine, config())
    paged = build_paged(Engine(mtp_model(), VOCAB, num_speculative_tokens=2), config())
    assert isinstance(paged, SpeculativePagedEngine) and "up to 2 drafts" in paged.startup_line()
    assert type(build_paged(Engine(mtp_model(), VOCAB), config())) is PagedEngine


def test_server_thread_streams_every_kept_token():
    """The server's paged thread (paged_batcher.py) with drafts: a step keeps several tokens of a request, each is
    streamed (in order) and the stream equals the answer."""
    import asyncio

    from paratron.inference.batcher import Job
    from paratron.inference.paged_batcher import PagedBatcher
    model = bigram_drafter(mtp_model(layers=1), attention=3.0, noise=0.3)
    engine = build_paged(Engine(model, VOCAB, num_speculative_tokens=2), config())

    async def run():
        job = Job([Request([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_new_tokens=12)),
                   Request([3, 40, 41, 42], SamplingParams(max_new_tokens=7))], asyncio.get_running_loop(), stream=True)
        batcher = PagedBatcher(engine)
        batcher.submit(job)
        results = await job.future
        steps = []
        while (step := await job.steps.get()) is not None:
            steps.append(step)
        batcher.stop()
        return results, steps
    results, steps = asyncio.run(run())
    for i, res in enumerate(results):
        assert [s[i] for s in steps if s[i] is not None] == res.tokens and len(res.tokens) > 5
    assert len(steps) > engine.steps - 3 and engine.stats()["speculative_tokens_per_step"] > 1.5


def test_pool_sized_with_the_depths_pools(models):
    """A pool given in GB holds the main layers' blocks and the K depths' of the same blocks: with K depths the
    block costs (layers + K) / layers as much, so fewer blocks fit, and all of them fit the buffer."""
    model = models["rejected"]
    gb = 64 * 2 ** -20
    cfg = config(num_blocks=None, buffer_size_gb=gb)
    plain = PagedEngine(Engine(model, VOCAB), cfg)
    spec = build_paged(Engine(model, VOCAB, num_speculative_tokens=2), cfg)
    layers = len(model.decoder.layers)
    assert spec.block_bytes * layers == plain.block_bytes * (layers + 2)
    assert spec.num_blocks < plain.num_blocks
    held = plain.num_blocks * plain.block_bytes  # the main pool's tensors, and then the depths'
    held_spec = sum(t.numel() * t.element_size() for t in spec.cache.buffers())
    held_spec += sum(p.k.numel() * p.k.element_size() * (1 if p.v is p.k else 2) for p in spec.depths)
    assert held <= gb * 2 ** 30 and held_spec <= gb * 2 ** 30

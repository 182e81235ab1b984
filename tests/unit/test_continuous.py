"""Continuous batching (paratron/inference/continuous.py) on a tiny Llama on CPU: requests that join a
running session mid-generation (one and two prompts, greedy and seeded sampling, log-probabilities)
get what each would get generated alone; one that cannot fit the running session's cache waits and
runs in the next session."""
from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("transformers")

from paratron.inference.batcher import Job  # noqa: E402
from paratron.inference.continuous import ContinuousBatcher  # noqa: E402
from paratron.inference.engine import Engine, Request  # noqa: E402
from paratron.inference.sampling import SamplingParams  # noqa: E402
from tests.unit.test_generate import PROMPTS, VOCAB, tiny_model  # noqa: E402


def alone(engine: Engine, req: Request):
    return engine.generate([req])[0]


async def _serve(batcher: ContinuousBatcher, first: list, later: list, after: int):
    """Submit ``first`` (streaming), wait for ``after`` of its steps, then submit each of ``later``."""
    loop = asyncio.get_running_loop()
    lead = Job(first, loop, stream=True)
    batcher.submit(lead)
    for _ in range(after):
        assert await asyncio.wait_for(lead.steps.get(), 60) is not None
    jobs = [Job(reqs, loop) for reqs in later]
    for job in jobs:
        batcher.submit(job)
    return await asyncio.wait_for(lead.future, 60), [await asyncio.wait_for(j.future, 60) for j in jobs]


@pytest.mark.parametrize("compiled", [False, True])
def test_requests_join_a_running_session_and_get_their_alone_results(compiled, monkeypatch):
    """``compiled``: the engine's decode step through DecodeRunner (torch.compile replaced by the identity on the
    CPU), whose argmax is taken for greedy rows unless a joining request wrote its row since."""
    if compiled:
        from paratron.inference import graphs
        monkeypatch.setattr(graphs.torch, "compile", lambda fn, **_: fn)
    engine = Engine(tiny_model(), VOCAB, compile=compiled)
    plain = Engine(engine.model, VOCAB)
    lead = [Request(PROMPTS[0], SamplingParams(max_new_tokens=20))]
    later = [[Request(PROMPTS[1], SamplingParams(max_new_tokens=9, logprobs=True, top_logprobs=2))],
             [Request(PROMPTS[2], SamplingParams(max_new_tokens=6, temperature=1.0, top_k=20, seed=5)),
              Request(PROMPTS[1], SamplingParams(max_new_tokens=0))],
             [Request(PROMPTS[2] + PROMPTS[1], SamplingParams(max_new_tokens=12))]]
    batcher = ContinuousBatcher(engine, max_batch=4, wait=0.0)
    try:
        got_lead, got_later = asyncio.run(_serve(batcher, lead, later, after=8))
    finally:
        batcher.stop()
    assert batcher.batches == 1 and batcher.joined == 4  # one session: every later request joined it
    for req, res in zip(lead + [r for job in later for r in job], got_lead + [r for rs in got_later for r in rs]):
        want = alone(plain, req)
        assert res.tokens == want.tokens and res.finish_reason == want.finish_reason
        if req.params.logprobs:
            assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(want.logprobs), atol=1e-5)
            assert torch.allclose(torch.tensor(res.prompt_logprobs[1:]), torch.tensor(want.prompt_logprobs[1:]),
                                  atol=1e-5)
            assert [[t for t, _ in step] for step in res.top_logprobs] == [[t for t, _ in s] for s in want.top_logprobs]
    assert got_later[1][1].tokens == []


def test_a_request_too_long_for_the_running_cache_waits_for_the_next_session():
    engine = Engine(tiny_model(), VOCAB)
    lead = [Request(PROMPTS[1], SamplingParams(max_new_tokens=14))]  # cache: 64 slots (the model's context)
    big = Request(PROMPTS[0], SamplingParams(max_new_tokens=57))  # fits an empty cache; after slot 7, no
    batcher = ContinuousBatcher(engine, max_batch=2, wait=0.0)
    try:
        got_lead, (got_big,) = asyncio.run(_serve(batcher, lead, [[big]], after=6))
    finally:
        batcher.stop()
    assert batcher.batches == 2 and batcher.joined == 0
    assert got_lead[0].tokens == alone(engine, lead[0]).tokens and got_big[0].tokens == alone(engine, big).tokens
    assert len(got_big[0].tokens) == 57 or got_big[0].finish_reason == "stop"


def test_bad_requests_fail_alone():
    engine = Engine(tiny_model(), VOCAB)
    batcher = ContinuousBatcher(engine, max_batch=2, wait=0.0)

    async def go():
        loop = asyncio.get_running_loop()
        bad, too_many = Job([Request([], SamplingParams())], loop), Job([Request([3])] * 3, loop)
        good = Job([Request(PROMPTS[1], SamplingParams(max_new_tokens=4))], loop)
        for job in (bad, too_many, good):
            batcher.submit(job)
        with pytest.raises(ValueError, match="prompt: is empty"):
            await asyncio.wait_for(bad.future, 60)
        with pytest.raises(ValueError, match="3 prompts"):
            await asyncio.wait_for(too_many.future, 60)
        return await asyncio.wait_for(good.future, 60)
    try:
        (res,) = asyncio.run(go())
    finally:
        batcher.stop()
    assert res.tokens == alone(engine, Request(PROMPTS[1], SamplingParams(max_new_tokens=4))).tokens

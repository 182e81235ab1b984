"""A streamed response's host work (inference/streaming.py, batcher.Steps): the server-sent events written from
parts encoded once are byte for byte ``json.dumps`` of the chunk's envelope; a response takes every step queued
since its last chunk with one wake-up; benchmarks/serve_host.py drives the real server over a stub engine."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from paratron.inference.api import envelope
from paratron.inference.batcher import Job, Steps
from paratron.inference.streaming import SseChunks, sse

ROOT = Path(__file__).resolve().parents[2]
DELTAS = ["", "hello", ' "quoted" \\ back', "new\nline\ttab\x00\x1f", "café 東京 🙂", "\ufffd", "</script>"]


@pytest.fixture
def frozen(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1764000000.75)


@pytest.mark.parametrize("reason", [None, "stop", "length"])
@pytest.mark.parametrize("delta", DELTAS)
def test_completion_chunks_are_json_dumps_of_the_envelope(frozen, delta, reason):
    cid, model = "cmpl-0123456789abcdef01234567", 'tiny "model" é'
    want = sse(envelope("text_completion", cid, model, [{"index": 3, "text": delta, "logprobs": None,
                                                          "finish_reason": reason}]))
    assert SseChunks(cid, model, chat=False)(3, delta, reason) == want


@pytest.mark.parametrize("reason", [None, "stop", "length"])
@pytest.mark.parametrize("delta", DELTAS)
def test_chat_chunks_are_json_dumps_of_the_envelope(frozen, delta, reason):
    cid, model = "chatcmpl-0123456789abcdef01234567", "m/ü"
    d = {"content": delta} if reason is None else {}
    want = sse(envelope("chat.completion.chunk", cid, model, [{"index": 0, "delta": d, "logprobs": None,
                                                               "finish_reason": reason}]))
    chunks = SseChunks(cid, model, chat=True)
    assert chunks(0, delta, reason) == want
    first = sse(envelope("chat.completion.chunk", cid, model, [
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))
    assert chunks.role(1) == first


def test_a_response_takes_every_queued_step_with_one_wake_up():
    """Steps put from another thread while the response waits: one wake-up takes all that queued (an asyncio.Queue
    woke it per item); ``get`` still takes one at a time."""
    async def main():
        loop = asyncio.get_running_loop()
        job = Job([None, None], loop, stream=True)
        assert isinstance(job.steps, Steps)
        release = threading.Event()

        def engine():
            release.wait()
            loop.call_soon_threadsafe(lambda: [job.steps.put_nowait([k, k]) for k in range(3)])
            job.finish(["a", "b"])
        threading.Thread(target=engine).start()
        loop.call_later(0.01, release.set)
        first = await asyncio.wait_for(job.steps.take(), 10)
        assert first[:3] == [[0, 0], [1, 1], [2, 2]]  # (and the end, if it came before the response ran)
        rest = first[3:]
        while not rest:
            rest += await asyncio.wait_for(job.steps.take(), 10)
        assert rest == [None]
        job.steps.put_nowait([5, 5])
        job.steps.put_nowait(None)
        assert await job.steps.get() == [5, 5] and await job.steps.get() is None and job.steps.empty()
        assert await job.future == ["a", "b"]
    asyncio.run(main())


def test_serve_host_benchmark_streams_through_the_server(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_host
    out, prof = serve_host.measure(serve_host.parse([
        "--clients", "8", "--rows", "8", "--new-min", "8", "--new-max", "16", "--warmup", "0.5", "--seconds", "1",
        "--profile"]))
    assert out["tokens_per_s"] > 0 and out["steps_per_s"] > 0 and out["loop_cpu_us_per_token"] > 0
    assert "tottime" in prof

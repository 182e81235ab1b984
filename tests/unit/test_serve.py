"""`paratron serve` on a tiny checkpoint, driven over 127.0.0.1 by the real `openai` client (completions,
chat, streaming) and by plain HTTP (Megatron's PUT /api, the 4xx cases); 100 concurrent requests, also
with --continuous-batching and with the paged engine (--inference-dynamic-batching)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from paratron.inference.engine import Engine, Request  # noqa: E402
from paratron.inference.load import load_for_inference  # noqa: E402
from paratron.inference.sampling import SamplingParams  # noqa: E402
from paratron.inference.text import PLAIN_STOPS, render_chat  # noqa: E402
from tests.dist import free_port  # noqa: E402
from tests.tiny_generation import make_tiny_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class Reference:
    """The same checkpoint in this process: what the server must answer (greedy)."""

    def __init__(self, ckpt: Path):
        loaded = load_for_inference(ckpt)
        self.tok = loaded.tokenizer
        self.engine = Engine(loaded.model, loaded.vocab_size, self.tok.eod, self.tok.detokenize)

    def texts(self, prompts: list, n: int, stop=()) -> list[str]:
        reqs = [Request(self.tok.tokenize(p), SamplingParams(n, stop=tuple(stop))) for p in prompts]
        return [r.text for r in self.engine.generate(reqs)]


def _server(tmp_path_factory, *flags):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("serve"))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "paratron", "serve", "--load", str(ckpt), "--port", str(port),
                             "--max-batch-size", "32", "--model-name", "tiny", *flags], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if json.loads(r.read())["status"] == "ok":
                        break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError("the server did not start:\n" + (proc.stdout.read() if proc.poll() is not None
                                                                          else "timeout"))
                time.sleep(0.3)
        yield url, Reference(ckpt)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _server(tmp_path_factory)


@pytest.fixture(scope="module")
def continuous_server(tmp_path_factory):
    """The same with --continuous-batching: requests join running batches."""
    yield from _server(tmp_path_factory, "--continuous-batching")


@pytest.fixture(scope="module")
def paged_server(tmp_path_factory):
    """The same with the paged engine: small blocks and step budget (chunked prefill, prefix caching)."""
    yield from _server(tmp_path_factory, "--inference-dynamic-batching", "--inference-dynamic-batching-block-size",
                       "4", "--inference-dynamic-batching-max-tokens", "48", "--enable-chunked-prefill",
                       "--inference-dynamic-batching-num-blocks", "160", "--inference-dynamic-batching-prefix-caching",
                       "--inference-dynamic-batching-prefix-caching-eviction-policy", "lru")


@pytest.fixture(scope="module")
def async_server(tmp_path_factory):
    """The paged engine with asynchronous steps (--inference-dynamic-batching-async-sched-mode async)."""
    yield from _server(tmp_path_factory, "--inference-dynamic-batching", "--inference-dynamic-batching-block-size",
                       "4", "--inference-dynamic-batching-max-tokens", "48", "--enable-chunked-prefill",
                       "--inference-dynamic-batching-num-blocks", "160", "--inference-dynamic-batching-async-sched-mode", "async")


def http(url: str, method: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("kind", ["server", "paged_server", "async_server"])
def test_openai_client_completions_chat_and_streaming(kind, request):
    url, ref = request.getfixturevalue(kind)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    want = ref.texts(["hello world"], 6)[0]
    out = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0)
    assert out.choices[0].text == want and out.usage.completion_tokens <= 6
    streamed = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick"}]
    prompt, stops = render_chat(messages, None, {})
    assert stops == PLAIN_STOPS and prompt.endswith("assistant:")
    want = ref.texts([prompt], 8, stops)[0]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
    deltas = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == want
    lp = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == len(lp.choices[0].logprobs.tokens)
    assert all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)


def test_megatron_api(server):
    url, ref = server
    prompts = ["hello world", "the lazy"]
    status, out = http(url + "/api", "PUT", {"prompts": prompts, "tokens_to_generate": 5, "temperature": 0.0,
                                             "logprobs": True})
    assert status == 200
    assert out["text"] == [p + t for p, t in zip(prompts, ref.texts(prompts, 5))]
    for text, seg, lp in zip(out["text"], out["segments"], out["logprobs"]):
        assert "".join(seg) == text and len(lp) == len(seg) - 1
    status, seeded = http(url + "/api", "PUT", {"prompts": ["the"], "tokens_to_generate": 8, "top_k": 20,
                                                "random_seed": 3})
    assert status == 200 and http(url + "/api", "PUT", {"prompts": ["the"], "tokens_to_generate": 8, "top_k": 20,
                                                        "random_seed": 3})[1]["text"] == seeded["text"]


@pytest.mark.parametrize("kind", ["server", "continuous_server", "paged_server", "async_server"])
def test_hundred_concurrent_requests(kind, request):
    url, ref = request.getfixturevalue(kind)
    words = ["hello", "the quick", "brown fox", "lazy dog", "hello there", "jumps over"]
    prompts = [f"{words[i % 6]} {words[(i // 6) % 6]}" for i in range(100)]
    lengths = [3 + i % 5 for i in range(100)]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    async def all_of_them():
        calls = [client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
                 for p, n in zip(prompts, lengths)]
        return await asyncio.gather(*calls)
    answers = asyncio.run(all_of_them())
    for n in set(lengths):
        rows = [i for i in range(100) if lengths[i] == n]
        for i, want in zip(rows, ref.texts([prompts[i] for i in rows], n)):
            assert answers[i].choices[0].text == want, prompts[i]
    with urllib.request.urlopen(url + "/health") as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["batches"] < 100  # batched together


@pytest.mark.parametrize("path,method,body,field", [
    ("/v1/completions", "POST", b'{"prompt": "hello", ', "body"),
    ("/v1/completions", "POST", {"prompt": "hello", "max_tokens": 2, "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", "POST", {"prompt": "hello", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", "POST", {"prompt": "hello " * 80, "max_tokens": 2}, "prompt"),
    ("/v1/completions", "POST", {"prompt": "hello", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", "POST", {"messages": [{"role": "user", "content": "hi " * 80}]}, "messages"),
    ("/v1/chat/completions", "POST", {"messages": []}, "messages"),
    ("/api", "PUT", {"prompts": ["hello"], "tokens_to_generate": -3}, "tokens_to_generate"),
    ("/api", "PUT", {"prompts": ["hello " * 80]}, "prompts"),
    ("/api", "PUT", {"prompts": ["hello"], "beam_width": 2}, "beam_width"),
])
def test_bad_requests_are_4xx_naming_the_field(server, path, method, body, field):
    url, _ = server
    status, out = http(url + path, method, body)
    assert 400 <= status < 500, out
    assert out["error"]["param"] == field and field in out["error"]["message"]
    assert http(url + "/v1/completions", "POST", {"prompt": "hi", "model": "other"})[0] == 404
    with urllib.request.urlopen(url + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_chat_template_of_the_tokenizer():
    from paratron.inference.text import render_chat
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    text, stops = render_chat([{"role": "user", "content": "hi"}], template, {"eos_token": "</s>"})
    assert text == "<|user|>hi</s><|assistant|>" and stops == ()
    with pytest.raises(ValueError, match="no system"):
        render_chat([{"role": "system", "content": "x"}], "{{ raise_exception('no system') }}", {})


def test_serve_load_benchmark_drives_a_server(paged_server):
    """benchmarks/serve_load.py's load (seeded, a shared prefix, Poisson arrivals) and its openai-client driver
    against the paged server: every request streams, the timings add up."""
    import importlib.util
    import types
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = types.SimpleNamespace(requests=6, rate=40.0, prompt_min=2, prompt_max=10, new_min=2, new_max=5, seed=0,
                                 shared_prefix=3, tiny=True)
    reqs = bench.load(args)
    assert reqs == bench.load(args) and len({tuple(p[:3]) for _, p, _ in reqs}) == 1  # seeded; the shared prefix
    assert [at for at, _, _ in reqs] == sorted(at for at, _, _ in reqs) and reqs[-1][0] > 0
    chunks = []
    out = bench.drive_all(paged_server[0], reqs, 1, "tiny", count=lambda text: chunks.append(text) or 1)
    assert out["output_tokens"] == len(chunks) > 0 and len(out["ttft"]) == len(out["e2e"]) <= len(reqs)
    assert len(out["itl"]) == len(chunks) - len(out["ttft"]) and min(out["ttft"]) > 0
    assert bench.tokens_in("<12><7>") == 2
    assert bench.percentiles([0.001, 0.002, 0.003]) == (2.0, 3.0)


def test_serve_runs_uvicorn_on_asyncio_not_uvloop(monkeypatch):
    """uvloop, picked by uvicorn's default when installed, starves the generation thread of the GIL
    (docs/inference.md "The host cost of streaming"): serve() asks for asyncio's loop."""
    from paratron.inference import server as srv

    class Stop(Exception):
        pass

    seen = {}

    def web(config):
        seen["loop"] = config.loop
        raise Stop

    class Model:
        run = None
    monkeypatch.setattr(srv, "_web_server", web)
    with pytest.raises(Stop):
        srv.serve(Model(), "127.0.0.1", 0, 4, 0.0, "m")
    assert seen["loop"] == "asyncio"

"""The server's queue limits (config/inference.py), over HTTP: past --serve-max-queued-requests or -tokens a
request is a 429 with Retry-After, a stopped generation thread a 503 with Retry-After; requests within the limits
are answered once the ones in flight are."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from paratron.config.inference import InferenceConfig  # noqa: E402
from paratron.inference.engine import Request, Result  # noqa: E402
from paratron.inference.server import Server, build_app  # noqa: E402
from tests.dist import free_port  # noqa: E402


class Held:
    """A TextModel whose batches wait until ``release`` is set (requests stay in flight)."""

    name = "tiny"

    def __init__(self):
        self.release = threading.Event()
        self.engine = SimpleNamespace(peak_cache_bytes=0)
        self.tok = SimpleNamespace(detokenize=lambda ids: "x" * len(ids))

    def check(self, requests):
        return None

    def requests(self, prompts, params, add_bos=False, first=0):
        return [Request([1, 2, 3], params) for _ in prompts]

    def run(self, requests, on_step=None):
        self.release.wait(30)
        return [Result(r.prompt, [4], "length", "x") for r in requests]


class Running:
    """``server`` behind uvicorn on a thread of this process."""

    def __init__(self, **limits):
        self.model = Held()
        self.server = Server(self.model, max_batch=8, wait=0.0, name="tiny", limits=InferenceConfig(**limits))
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.web = uvicorn.Server(uvicorn.Config(build_app(self.server), port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.web.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.web.started and time.time() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self.model.release.set()
        self.web.should_exit = True
        self.thread.join(30)
        self.server.batcher.stop()


def post(url: str, path: str = "/v1/completions", body=None):
    """(status, headers, body) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


ONE = {"prompt": "hi", "max_tokens": 1}  # 3 prompt tokens + 1


@pytest.mark.parametrize("limit,field", [({"serve_max_queued_requests": 2}, "requests"),
                                         ({"serve_max_queued_tokens": 9}, "tokens")])
def test_past_the_queue_limits_a_request_is_a_429_with_retry_after(limit, field):
    run = Running(**limit)
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, run.url, body=ONE) for _ in range(2)]
            while run.server.queued[0] < 2:
                time.sleep(0.01)
            status, headers, body = post(run.url, body=ONE)
            run.model.release.set()
            answered = [f.result()[0] for f in held]
        later = post(run.url, body=ONE)[0]
    finally:
        run.close()
    assert status == 429 and 1 <= int(headers["retry-after"]) <= 60
    assert f"too many {field}" in body["error"]["message"]
    assert answered == [200, 200] and later == 200 and run.server.queued == [0, 0]


def test_a_stopped_generation_thread_is_a_503_with_retry_after():
    run = Running()
    try:
        run.model.release.set()
        run.server.batcher.stop()
        refused, health = post(run.url, body=ONE), post(run.url, "/health")
    finally:
        run.close()
    assert refused[0] == 503 and health[0] == 503
    assert refused[1]["retry-after"] == "60" and health[1]["retry-after"] == "60"

"""Issue 49: `paratron serve` on SIGTERM finishes the request in flight, logs its shutdown and exits 0 (it
died of the signal before: exit 143, no line)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from tests.dist import free_port  # noqa: E402
from tests.servers import wait_until_healthy  # noqa: E402
from tests.tiny_generation import make_tiny_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _start(ckpt: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "paratron", "serve", "--load", str(ckpt), "--port", str(port)],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return wait_until_healthy(proc, port, 120)


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_a_signal_finishes_the_request_in_flight_logs_and_exits_0(tmp_path, sig):
    port = free_port()
    proc = _start(make_tiny_checkpoint(tmp_path), port)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": "hello world", "max_tokens": 40, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()  # the stream has begun: the request is in flight
        assert first.startswith(b"data: "), first
        proc.send_signal(sig)
        rest = resp.read().decode()
        assert rest.rstrip().endswith("data: [DONE]"), rest  # answered to its end
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    name = signal.Signals(sig).name
    assert f"paratron serve: {name} received; finishing the requests in flight" in out, out
    assert f"paratron serve: shut down ({name}) after" in out and "Traceback" not in out, out

"""Waiting for a `paratron serve` process the tests started."""
from __future__ import annotations

import subprocess
import time
import urllib.request
from typing import Callable, Optional


def wait_until_healthy(proc: subprocess.Popen, port: int, timeout: float,
                       kill: Optional[Callable[[], None]] = None) -> subprocess.Popen:
    """``proc`` once GET /health answers on ``port``; if it exits or ``timeout`` seconds pass first, it is killed
    (``kill``, default ``proc.kill``) and the test fails with its output."""
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                try:
                    (kill or proc.kill)()
                except ProcessLookupError:  # the server's process group has exited already
                    pass
                raise AssertionError("the server did not start:\n" + proc.communicate()[0])
            time.sleep(0.3)

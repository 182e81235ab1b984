"""Run a script under Triton's CPU interpreter (tests of paratron's Triton kernels on machines without a GPU)."""
import os
import subprocess
import sys


def interpret(script: str) -> None:
    """Run ``script`` in a fresh interpreter with Triton's CPU interpreter on; it prints "ok" when its checks hold."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr

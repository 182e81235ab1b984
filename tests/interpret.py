"""Run a script under Triton's CPU interpreter (tests of paratron's Triton kernels on machines without a GPU)."""
import os
import subprocess
import sys


def interpret(script: str) -> None:
    """Run ``script`` in a fresh interpreter with Triton's CPU interpreter on; it prints "ok" when its checks hold.
    Floating-point contraction (a * b + c as one fused multiply-add, which Triton 3.9's interpreter emulates when
    fusion is on) is off, so that each operation rounds as the torch reference's does; whether the GPU build fuses
    is a code-generation choice its CUDA tests cover with their own tolerances."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="0")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr

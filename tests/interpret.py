"""Run a script under Triton's CPU interpreter (tests of paratron's Triton kernels on machines without a GPU).

Each script runs in a process of its own, forked from one helper process per test session that was started with
the interpreter's environment and has imported torch and triton once (a fresh interpreter per script paid ~3 s of
CPU for those imports). The script imports paratron's kernels itself, after the fork, so that ``triton.jit`` sees
the interpreter switched on."""
import functools
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER = r"""
import os, struct, sys
import torch, triton  # noqa: F401 (imported once, before the forks)
from tests.forked import run_as_main
while True:
    head = sys.stdin.buffer.read(4)
    if len(head) < 4:
        break
    out, script = sys.stdin.buffer.read(struct.unpack("<I", head)[0]).decode().split("\n", 1)
    pid = os.fork()
    if pid == 0:
        run_as_main(out, lambda: exec(compile(script, "<script>", "exec"), {"__name__": "__main__"}))
    _, status = os.waitpid(pid, 0)
    sys.stdout.write(f"{os.waitstatus_to_exitcode(status)}\n")
    sys.stdout.flush()
"""


@functools.lru_cache(maxsize=1)
def _server() -> subprocess.Popen:
    """The helper process (one per test session), with Triton's interpreter on and floating-point contraction off."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="0")
    return subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            cwd=Path(__file__).resolve().parents[1], start_new_session=True)


def interpret(script: str, timeout: float = 300) -> None:
    """Run ``script`` with Triton's CPU interpreter on; it prints "ok" when its checks hold.
    Floating-point contraction (a * b + c as one fused multiply-add, which Triton 3.9's interpreter emulates when
    fusion is on) is off, so that each operation rounds as the torch reference's does; whether the GPU build fuses
    is a code-generation choice its CUDA tests cover with their own tolerances."""
    if _server().poll() is not None:  # (the helper died: a new one)
        _server.cache_clear()
    server = _server()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "script")
        payload = f"{out}\n{script}".encode()
        server.stdin.write(struct.pack("<I", len(payload)) + payload)
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        if not ready:  # a hang: the helper and its child go, the next script starts a new one
            os.killpg(server.pid, signal.SIGKILL)
            _server.cache_clear()
            raise AssertionError(f"no result after {timeout} s")
        code = int(server.stdout.readline() or b"-1")
        stdout, stderr = (Path(out + s).read_text() if Path(out + s).exists() else "" for s in (".out", ".err"))
    assert code == 0 and stdout.strip().endswith("ok"), stdout + stderr

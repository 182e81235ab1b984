"""Run `pretrain_gpt.py` as a user would (torchrun for several processes, gloo on CPU) and read the
`lm loss:` values of Megatron's log lines."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"lm loss: ([0-9.E+-]+) \|")


def run_pretrain(nproc: int, flags: list[str], iters: int, timeout: int = 300,
                 log_dir: Optional[Path] = None, script: str = "pretrain_gpt.py") -> list[float]:
    """The per-iteration losses of one run of ``script``; a hang is killed (torchrun and every rank) and fails."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd + [script, *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"no result after {timeout} s (a hang?):\n{(stdout + stderr)[-3000:]}")
    out = stdout + stderr
    if log_dir is not None:
        (log_dir / f"run_{nproc}.log").write_text(out)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-3000:]}"
    losses = [float(x) for x in LOSS.findall(stdout)]
    assert len(losses) == iters, f"expected {iters} log lines with 'lm loss:', got {len(losses)}:\n{out[-3000:]}"
    return losses

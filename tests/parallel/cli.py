"""Run `pretrain_gpt.py` as a user would and read the `lm loss:` values of Megatron's log lines.

Each rank is a process of its own, given the environment torchrun gives it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; one thread), that runs the script as ``python script flags`` does
(``__main__``, its argv, its exit status). The ranks are forked from the test session's fork server
(tests/dist.py), which has imported torch, torch._dynamo and paratron once: started afresh through torchrun, every
rank paid ~5 s of CPU for those imports and torchrun's agent ~2.5 s more, most of a small run's time on 2 cores.
torchrun's own launch (its agent, rendezvous and restarts) is tested where it is the subject
(tests/parallel/test_launch.py, test_multinode.py, tests/unit/test_fault_tolerance.py)."""
from __future__ import annotations

import multiprocessing
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

from tests.dist import PRELOAD, free_port
from tests.forked import run_as_main

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"lm loss: ([0-9.E+-]+) \|")


def _rank_main(script: str, flags: list[str], env: dict, out: str) -> None:
    """One rank: the script as ``__main__`` (tests/forked.py), its stdout and stderr into ``out``.out / .err."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    import warnings
    import torch
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if script == "-m":  # ("-m", [module, *args]: python -m module args)
        sys.argv = flags
        run_as_main(out, lambda: runpy.run_module(flags[0], run_name="__main__", alter_sys=True))
    else:
        sys.argv = [script, *flags]
        run_as_main(out, lambda: runpy.run_path(str(ROOT / script), run_name="__main__"))


class Launch:
    """``nproc`` ranks of ``script`` started (rank 0 first); :meth:`wait` collects them."""

    def __init__(self, nproc: int, script: str, flags: list[str], out_dir: Path, env: Optional[dict] = None):
        multiprocessing.set_forkserver_preload(PRELOAD)
        ctx = multiprocessing.get_context("forkserver")
        base = dict(os.environ if env is None else env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        port = free_port()
        self.procs, self.outs = [], []
        for rank in range(nproc):
            rank_env = dict(base) if nproc == 1 else dict(
                base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            self.outs.append(str(Path(out_dir) / f"rank{rank}"))
            self.procs.append(ctx.Process(target=_rank_main, args=(script, flags, rank_env, self.outs[-1])))
            self.procs[-1].start()

    def _read(self, suffix: str) -> str:
        return "".join(Path(o + suffix).read_text(errors="replace") for o in self.outs if Path(o + suffix).exists())

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """The ranks' exit status (the first failing rank's, else 0) and their stdout and stderr, rank by rank. As
        torchrun, a rank that fails ends the others (they would wait for it in a collective); a launch still running
        after ``timeout`` seconds is killed and fails the test."""
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            if any(p.exitcode for p in self.procs):
                break
            time.sleep(0.05)
        code = next((p.exitcode for p in self.procs if p.exitcode), 0)  # (before the others are killed)
        hung = not code and any(p.is_alive() for p in self.procs)
        self.kill()
        out, err = self._read(".out"), self._read(".err")
        if hung:
            pytest.fail(f"no result after {timeout} s (a hang?):\n{(out + err)[-3000:]}")
        return subprocess.CompletedProcess(self.procs[0].name, code, out, err)


def run_script(nproc: int, script: str, flags: list[str], timeout: float = 300,
               env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``script`` (a path from the repository's root, or "-m" with the module first in ``flags``) with ``flags`` on
    ``nproc`` ranks (one: no distributed environment), as ``subprocess.run`` with captured text output returns it.
    A launch whose rendezvous port another process took first is launched again on another port, at most twice."""
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(3):
            run_dir = Path(tmp) / str(attempt)
            run_dir.mkdir()
            r = Launch(nproc, script, flags, run_dir, env).wait(timeout)
            if not (r.returncode and "EADDRINUSE" in r.stdout + r.stderr and attempt < 2):
                return r


def run_pretrain(nproc: int, flags: list[str], iters: int, timeout: int = 300,
                 log_dir: Optional[Path] = None, script: str = "pretrain_gpt.py") -> list[float]:
    """The per-iteration losses of one run of ``script`` on ``nproc`` ranks; a hang is killed and fails."""
    r = run_script(nproc, script, flags, timeout)
    out = r.stdout + r.stderr
    if log_dir is not None:
        (log_dir / f"run_{nproc}.log").write_text(out)
    assert r.returncode == 0, f"exit {r.returncode}:\n{out[-3000:]}"
    losses = [float(x) for x in LOSS.findall(r.stdout)]
    assert len(losses) == iters, f"expected {iters} log lines with 'lm loss:', got {len(losses)}:\n{out[-3000:]}"
    return losses

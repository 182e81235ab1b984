"""A 2-"node" job on one host: two torchrun agents (one process each) meet through the c10d
rendezvous on 127.0.0.1, as two nodes of a SLURM job do (examples/slurm/train.sbatch), and log the
losses of the one-process run."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.parallel.cli import LOSS, ROOT
from tests.parallel.test_cli_parallel import FLAGS, ITERS, check, single  # noqa: F401 (fixture)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_rendezvous_and_match_one_process(single):  # noqa: F811
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ft",
                                "--max-restarts", "0", "pretrain_gpt.py", *FLAGS, "--tensor-model-parallel-size", "2"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True) for _ in range(2)]
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=240))
    except subprocess.TimeoutExpired:
        for a in agents:
            os.killpg(a.pid, signal.SIGKILL)
        pytest.fail("the two agents did not finish in 240 s (rendezvous hang?)")
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    losses = [float(x) for out, _ in outs for x in LOSS.findall(out)]  # printed by the last rank's agent
    assert len(losses) == ITERS, outs
    check(single, losses)

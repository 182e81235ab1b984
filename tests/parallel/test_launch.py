"""Under torchrun a user error is one line, printed by one rank; `paratron launch` ends with that line
and exit code 2 (not torch's agent report); a TP+SP run prints each warning once and no deprecation."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from paratron.data.indexed import write_dataset
from tests.parallel.test_cli_tp import FLAGS

ROOT = Path(__file__).resolve().parents[2]
BAD = ["--config", "tiny", "--device", "cpu", "--micro-batch-size", "3", "--global-batch-size", "4"]


def run(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_launcher_ends_a_user_error_with_its_one_line_and_exit_2():
    r = run(["-m", "paratron", "launch", "--standalone", "--nproc-per-node", "2", "train", *BAD])
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("paratron: error: --global-batch-size 4"), lines


def test_launcher_runs_a_script_as_torchrun_does():
    r = run(["-m", "paratron.launch", "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py", *BAD])
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error:"), lines


def test_plain_torchrun_prints_the_error_from_one_rank():
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py", *BAD])
    printed = [x for x in r.stderr.splitlines() if x.startswith("pretrain_gpt.py: error:")]
    assert len(printed) == 1, r.stderr[-3000:]
    assert "traceback : pretrain_gpt.py: error: --global-batch-size" in r.stderr  # the agent's report shows it


def test_tp_sp_run_warns_once_and_calls_no_deprecated_collective(tmp_path):
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "d")
    write_dataset(prefix, [rng.integers(0, 500, size=int(rng.integers(40, 90))) for _ in range(12)])
    flags = [f for f in FLAGS if f != "--mock-data"] + [
        "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"), "--split", "98,1,1",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "2", "--device", "cpu",
        "--eval-iters", "1"]
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py", *flags])
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "deprecated" not in out and "FutureWarning" not in out, out[-3000:]
    assert out.count("the valid split") == 1, out[-3000:]

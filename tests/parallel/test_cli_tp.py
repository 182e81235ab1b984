"""The command line under torchrun with tensor (and sequence) parallelism logs the losses of the
one-process run, and the seed's minimal library example runs on 2 CPU processes."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.cli import run_pretrain

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "6", "--lr", "3e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "512", "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
         "--adam-eps", "1e-6"]


def run(nproc: int, *extra: str) -> list[float]:
    return run_pretrain(nproc, FLAGS + list(extra), iters=6)


@pytest.fixture(scope="module")
def single():
    return run(1)


@pytest.mark.parametrize("extra", [["--tensor-model-parallel-size", "2"],
                                   ["--tensor-model-parallel-size", "2", "--sequence-parallel"]])
def test_cli_tp_matches_single_process(single, extra):
    got = run(2, *extra)
    for a, b in zip(single, got):
        assert abs(a - b) <= 1e-4 * abs(a), (single, got)


def test_minimal_library_example_on_two_cpu_processes():
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "examples/run_simple_gpt.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert "reloaded: identical" in r.stdout

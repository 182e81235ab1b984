"""The command line under torchrun with pipeline parallelism logs the losses of the one-process run.

`python -m torch.distributed.run --nproc-per-node N pretrain_gpt.py ... --mock-data` on CPU/gloo, a
4-layer model, 8 micro-batches per step; the `lm loss:` values of Megatron's log line (printed by the
last rank, on the last pipeline stage) are compared within 1e-4 relative."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.parallel.cli import ROOT, run_pretrain

ITERS = 3
FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "1", "--adam-eps", "1e-6",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
         "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--device", "cpu"]


def run(nproc: int, *extra: str) -> list[float]:
    return run_pretrain(nproc, FLAGS + list(extra), ITERS)


@pytest.fixture(scope="module")
def single():
    return run(1)


def check(single: list[float], got: list[float]) -> None:
    for a, b in zip(single, got):
        assert abs(a - b) <= 1e-4 * abs(a), (single, got)


def test_cli_pp2(single):
    check(single, run(2, "--pipeline-model-parallel-size", "2"))


def test_cli_pp2_accounted_split(single):
    """Megatron's --account-for-embedding/loss-in-pipeline-split: 4 layers as Ett|ttL."""
    check(single, run(2, "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
                      "--account-for-loss-in-pipeline-split"))


@pytest.mark.slow  # (13 s; pp2 and its virtual stages stay in CI)
def test_cli_pp4(single):
    check(single, run(4, "--pipeline-model-parallel-size", "4"))


def test_cli_pp2_virtual2(single):
    check(single, run(2, "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"))


def test_cli_pp2_virtual2_groups_of_4(single):
    """--microbatch-group-size-per-virtual-pipeline-stage 4: the 8 micro-batches in two groups of 4."""
    check(single, run(2, "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                      "--microbatch-group-size-per-virtual-pipeline-stage", "4"))


def test_cli_tp2_pp2(single):
    check(single, run(4, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"))


def test_cli_layout_error_is_one_line():
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS, "--pipeline-model-parallel-size", "3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3" in err[0], err

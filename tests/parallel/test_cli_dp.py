"""The command line under torchrun: data-parallel runs log the losses of the one-process run.

`python -m torch.distributed.run --nproc-per-node N pretrain_gpt.py ...` on CPU/gloo with a tiny
model and mock data; the `lm loss:` values of Megatron's log line are compared within 1e-4."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.cli import run_pretrain

ROOT = Path(__file__).resolve().parents[2]
ITERS = 4
TIMEOUT = 300  # seconds per run
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "1", "--adam-eps", "1e-6",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
        "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--device", "cpu"]


def run_cli(nproc: int, extra: list[str], tmp_path: Path) -> list[float]:
    return run_pretrain(nproc, ARGS + extra, ITERS, TIMEOUT, log_dir=tmp_path)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_cli(1, [], tmp_path_factory.mktemp("cli1"))


def assert_losses_close(ref: list[float], got: list[float], rtol: float = 1e-4) -> None:
    for i, (a, b) in enumerate(zip(ref, got)):
        assert abs(a - b) <= rtol * abs(a), f"iteration {i + 1}: lm loss {b} vs one process {a}"


@pytest.mark.parametrize("extra", [
    [],
    ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "4000"],
], ids=["plain", "distopt-overlap"])
def test_cli_dp2_logs_single_process_losses(single, tmp_path, extra):
    assert_losses_close(single, run_cli(2, extra, tmp_path))


@pytest.mark.slow  # (8 processes, 27 s: tp2 x pp2 and dp2 each stay in CI)
def test_cli_tp2_pp2_dp2_logs_single_process_losses(single, tmp_path):
    extra = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert_losses_close(single, run_cli(8, extra, tmp_path))

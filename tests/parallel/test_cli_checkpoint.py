"""The command line saves sharded checkpoints and resumes them in another layout: a run at TP2 x PP2
stopped by --exit-interval, resumed at DP4 with the distributed optimizer, at TP2 x DP2 and at
interleaved PP2 x DP2 (2 virtual stages), logs the losses of an uninterrupted one-process run
(within 1e-4 relative)."""
from __future__ import annotations

import shutil

import pytest

from tests.parallel.cli import run_pretrain
from tests.parallel.test_cli_parallel import FLAGS

ITERS, STOP = 6, 3
ARGS = list(FLAGS)
ARGS[ARGS.index("--train-iters") + 1] = str(ITERS)


@pytest.fixture(scope="module")
def single():
    return run_pretrain(1, ARGS, ITERS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_ckpt") / "ckpt"
    losses = run_pretrain(4, ARGS + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--exit-interval", str(STOP), "--save", str(root)], STOP)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(STOP)
    return root, losses


@pytest.mark.parametrize("layout", [["--use-distributed-optimizer", "--overlap-grad-reduce"],
                                    ["--tensor-model-parallel-size", "2"],
                                    pytest.param(["--pipeline-model-parallel-size", "2",
                                                  "--virtual-pipeline-model-parallel-size", "2"],
                                                 marks=pytest.mark.slow)],  # (16 s; the other two stay in CI)
                         ids=["dp4_distopt", "tp2_dp2", "pp2_vpp2_dp2"])
def test_cli_resumes_in_another_layout(single, saved, layout, tmp_path):
    root, first = saved
    for a, b in zip(single[:STOP], first):
        assert abs(a - b) <= 1e-4 * abs(a), (single, first)
    copy = tmp_path / "ckpt"  # each resume saves into its own copy
    shutil.copytree(root, copy)
    rest = run_pretrain(4, ARGS + layout + ["--load", str(copy), "--save", str(copy)], ITERS - STOP)
    for i, (a, b) in enumerate(zip(single[STOP:], rest)):
        assert abs(a - b) <= 1e-4 * abs(a), f"iteration {STOP + i + 1}: {b} vs one process {a}"
    assert (copy / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)

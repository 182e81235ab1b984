"""--load MEGATRON_DIR (no --finetune) in parallel layouts (gloo): Megatron-LM's checkpoints with optimizer state
(tests/data/megatron_ckpt/optim) resumed at iteration 3 continue with the losses of Megatron's own uninterrupted run,
in another layout than they were saved in where the format allows it (tests/unit/test_megatron_resume.py: one
process)."""
from __future__ import annotations

import pytest

from tests.parallel.cli import run_pretrain
from tests.unit.test_megatron_resume import CASES, DATA, EXTRA, FLAGS, WANT


@pytest.mark.parametrize("case,layout,tol", [
    ("distopt_tp2_dp2_bf16", ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"], 1e-2),
    pytest.param("moe_distopt_ep2_full", ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"], 5e-6,
                 marks=pytest.mark.slow),  # (one process: tests/unit/test_megatron_resume.py)
    pytest.param("distopt_dp2", ["--use-distributed-optimizer"], 5e-6, marks=pytest.mark.slow),
    ("plain_tp2_bf16", ["--pipeline-model-parallel-size", "2", "--bf16"], 1e-2),
    ("distopt_pp2", ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], 5e-6),
    ("moe_distopt_ep2", ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"], 5e-6),
    ("distopt_pp2_vpp2_dp2", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                              "--use-distributed-optimizer", "--global-batch-size", "4"], 5e-6),
    ("legacy_plain_tp2_bf16", ["--tensor-model-parallel-size", "2", "--bf16"], 1e-2),
    ("legacy_distopt_pp2", ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], 5e-6),
], ids=["dp-reshardable-tp2", "moe-ep2", "dp-reshardable-dp2", "plain-pp2", "dp-reshardable-pp2",
        "dp-reshardable-moe-ep2", "dp-reshardable-pp2-vpp2", "legacy-plain-tp2", "legacy-distopt-pp2"])
def test_megatron_resume_in_parallel_layouts(case, layout, tol):
    extra = [f for f in CASES.get(case, (EXTRA.get(case, []), 0))[0] if f != "--bf16"]
    got = run_pretrain(2, ["--load", str(DATA / case), *FLAGS, *extra, *layout], 3)
    want = WANT[case]["lm_loss"][3:]
    assert all(abs(g - w) <= tol * abs(w) for g, w in zip(got, want)), (got, want)


@pytest.mark.slow
def test_megatron_resume_at_its_own_tp2_dp2_layout():
    got = run_pretrain(4, ["--load", str(DATA / "distopt_tp2_dp2_bf16"), *FLAGS, "--bf16",
                           "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], 3)
    want = WANT["distopt_tp2_dp2_bf16"]["lm_loss"][3:]
    assert all(abs(g - w) <= 1e-2 * abs(w) for g, w in zip(got, want)), (got, want)

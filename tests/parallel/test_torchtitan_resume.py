"""A torchtitan run (tests/data/torchtitan_ckpt, saved at step 3 by torchtitan 0.2.2) converted, then resumed by
``pretrain_gpt.py --load`` at TP 2 and with the distributed optimizer at DP 2 (gloo): torchtitan's losses of steps 4
to 6 (tests/unit/test_torchtitan_checkpoint.py: one process)."""
from __future__ import annotations

import pytest

from tests.parallel.cli import run_pretrain
from tests.unit.test_torchtitan_checkpoint import FLAGS, RUN, converted, model_flags


# (TP 2 pads the vocabulary to a multiple of 64 x 2 = its 128 rows: more rows, zeros here, would change the softmax)
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
                                    ["--use-distributed-optimizer", "--global-batch-size", "2",
                                     "--micro-batch-size", "1"]], ids=["tp2", "dp2-distributed-optimizer"])
def test_torchtitan_resume_in_parallel_layouts(tmp_path, layout):
    converted(tmp_path)
    got = run_pretrain(2, model_flags(tmp_path) + ["--load", str(tmp_path / "ckpt"), *FLAGS, *layout], 3)
    want = [s["loss"] for s in RUN["steps"]][3:]
    assert all(abs(g - w) <= 1e-4 * w for g, w in zip(got, want)), (got, want)

"""--load MEGATRON_DIR --finetune at TP 2 and PP 2 (gloo): the torch_dist checkpoint Megatron-LM wrote
(tests/data/megatron_ckpt, a Mamba-2 hybrid too) read straight into each rank's parameters gives the losses of the
same run from its converted paratron checkpoint (whose logits tests/unit/test_megatron_fixtures.py and
test_megatron_hybrid.py check against Megatron's)."""
from __future__ import annotations

import pytest

from paratron.checkpoint import convert as C
from tests.parallel.cli import run_pretrain
from tests.unit.test_megatron_fixtures import DATA, _run_flags

ITERS = 2


@pytest.mark.parametrize("case,layout", [
    ("gpt_tp2", ["--tensor-model-parallel-size", "2"]),
    pytest.param("gpt_tp2", ["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
    pytest.param("moe_gg_tp2", ["--expert-model-parallel-size", "2", "--global-batch-size", "4"],
                 marks=pytest.mark.slow),
    ("mamba_tp2", ["--tensor-model-parallel-size", "2"]),  # (each rank's share of in_proj's five torch_dist blocks)
    pytest.param("hybrid_moe_ep2", ["--expert-model-parallel-size", "2", "--global-batch-size", "4"],
                 marks=pytest.mark.slow),
], ids=["dense-tp2", "dense-pp2", "moe-ep2", "hybrid-tp2", "hybrid-moe-ep2"])
def test_direct_megatron_load_equals_the_converted_checkpoint(tmp_path, case, layout):
    flags = C.from_megatron(DATA / f"dist_{case}", tmp_path / "conv", log=lambda *a: None)
    base = _run_flags(flags, "--train-iters", str(ITERS), "--log-interval", "1", *layout)
    direct = run_pretrain(2, base + ["--load", str(DATA / f"dist_{case}"), "--finetune"], ITERS)
    converted = run_pretrain(2, base + ["--load", str(tmp_path / "conv"), "--finetune"], ITERS)
    assert direct == converted, (direct, converted)

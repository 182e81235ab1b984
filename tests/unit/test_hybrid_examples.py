"""Megatron's examples/mamba/train.sh runs verbatim, scaled down (benchmarks/megatron_examples.py: sizes, parallel
degrees, data and paths only) through pretrain_hybrid.py on one CPU process. (The Gated DeltaNet functional test
runs through the same benchmark: benchmarks/results/megatron_examples.md.)"""
import json
import re

import pytest

from benchmarks.megatron_examples import ENTRY, ITERS, SCRIPTS, scale, tiny_gpt2
from paratron.cli import pretrain_main


@pytest.mark.slow
def test_megatron_mamba_example_runs_scaled_down(tmp_path, capsys):
    script = "examples/mamba/train.sh"
    flags = json.loads(SCRIPTS.read_text())[script]
    argv, _ = scale(flags, tmp_path, tiny_gpt2(tmp_path))
    prog = ENTRY.get(script, "pretrain_gpt.py")
    assert pretrain_main(argv, prog=prog, hybrid=prog != "pretrain_gpt.py") == 0
    out = capsys.readouterr().out
    assert re.search(rf"iteration\s+{ITERS}/\s*{ITERS} \|", out), out[-2000:]

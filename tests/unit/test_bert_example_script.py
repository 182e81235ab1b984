"""Megatron-LM's examples/bert/train_bert_340m_distributed.sh, its flags verbatim but sizes, parallel degrees,
data and paths (benchmarks/megatron_examples.py's scaling), runs to the end through pretrain_bert.py on CPU."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import megatron_examples  # noqa: E402

SCRIPT = "examples/bert/train_bert_340m_distributed.sh"


@pytest.mark.slow
def test_bert_example_script_runs_scaled_down():
    flags = json.loads(open(os.path.join(ROOT, "tests", "data", "megatron_example_scripts.json")).read())[SCRIPT]
    assert ["--fp16"] in flags and ["--tensor-model-parallel-size", "8"] in flags  # the script as Megatron has it
    result = megatron_examples.run_one(SCRIPT, flags)
    assert result["result"] == "runs to the end", result

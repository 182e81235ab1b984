"""The smaller points of a newcomer's first hour (issue 48, item 6): every batch problem reported together,
--seq-length beyond --max-position-embeddings with RoPE, per-prompt random draws of one --seed,
`paratron tokenizer --help`, and a converted HF checkpoint that keeps its tokenizer."""
import pytest

from paratron.config import parse_args
from paratron.config.rules import ConfigProblems

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--mock-data", "--vocab-size", "128", "--train-iters", "2", "--lr", "1e-3"]


def test_batch_mistakes_are_reported_with_the_other_problems():
    flags = BASE + ["--num-attention-heads", "5", "--micro-batch-size", "4", "--global-batch-size", "10",
                    "--rampup-batch-size", "3", "4", "100"]
    with pytest.raises(ConfigProblems) as e:
        parse_args(flags, world_size=2)
    text = " ".join(e.value.problems)
    assert len(e.value.problems) == 4, e.value.problems
    assert "--num-attention-heads" in text and "not divisible by --micro-batch-size 4" in text
    assert "minus START 3" in text and "must be multiples of --micro-batch-size" in text

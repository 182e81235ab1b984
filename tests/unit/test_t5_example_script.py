"""Megatron's examples/t5/train_t5_220m_distributed.sh (its flags as tests/data/megatron_example_scripts.json holds
them) runs through pretrain_t5.py on one CPU process with only the sizes, the paths and the backend (gloo: a CPU)
changed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from bert_helpers import bert_data  # noqa: E402

SCRIPT = "examples/t5/train_t5_220m_distributed.sh"
SIZES = {"--encoder-num-layers": "2", "--decoder-num-layers": "1", "--hidden-size": "32", "--num-attention-heads": "4",
         "--kv-channels": "8", "--ffn-hidden-size": "64", "--encoder-seq-length": "64", "--decoder-seq-length": "32",
         "--max-position-embeddings": "64", "--micro-batch-size": "2", "--global-batch-size": "4",
         "--train-iters": "3", "--lr-decay-iters": "3", "--log-interval": "1", "--save-interval": "3",
         "--eval-interval": "3", "--eval-iters": "1"}


@pytest.mark.slow
def test_t5_example_script_scaled_down(tmp_path):
    prefix, vocab = bert_data(tmp_path, docs=60, vocab_size=120)
    paths = {"$DATA_PATH": prefix, "$VOCAB_FILE": vocab, "${TENSORBOARD_DIR}": str(tmp_path / "tb"),
             "$CHECKPOINT_PATH": str(tmp_path / "ckpt"), "nccl": "gloo"}
    flags = json.loads((ROOT / "tests" / "data" / "megatron_example_scripts.json").read_text())[SCRIPT]
    argv = []
    for flag, *values in flags:
        argv += [flag, *([SIZES[flag]] if flag in SIZES else [paths.get(v, v) for v in values])]
    assert "--bf16" in argv and "--vocab-extra-ids" in argv and "--tokenizer-type" in argv  # kept as written
    r = subprocess.run([sys.executable, "pretrain_t5.py", *argv, "--device", "cpu"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.count("lm loss:") == 3 and "saved checkpoint at iteration       3" in r.stdout

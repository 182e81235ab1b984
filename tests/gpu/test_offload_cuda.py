"""--optimizer-cpu-offload on CUDA: the offloaded masters and Adam moments are in pinned host memory, the
losses follow the run without offload, and a checkpoint saved with offload resumes without it."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FLAGS = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--lr", "1e-3", "--train-iters", "4",
         "--eval-iters", "0", "--clip-grad", "1.0", "--bf16", "--device", "cuda"]
OFFLOAD = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]


def _run(flags: list[str], steps: int = 4):
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    t = Trainer(parse_args(FLAGS + flags))
    losses = [float(r[0] / r[1]) for r, _, _ in (t.train_step() for _ in range(steps))]
    return t, losses


def test_offloaded_state_is_pinned_on_the_host_and_losses_follow(tmp_path):
    t, off = _run(OFFLOAD)
    host = [t.optimizer.masters[i] for i in t.optimizer.host.indices]
    assert host and all(m.device.type == "cpu" and m.is_pinned() for m in host)
    assert all(s["exp_avg"].device.type == "cpu" for m in host for s in [t.optimizer.adam.state[m]])
    assert 0 < t.optimizer.host_state_bytes() < t.optimizer.state_bytes()
    t.close()
    t, plain = _run([])
    t.close()
    for a, b in zip(plain, off):
        assert abs(a - b) <= 1e-4 * abs(a), (plain, off)


def test_checkpoint_with_offload_resumes_without(tmp_path):
    t, straight = _run([])
    t.close()
    t, _ = _run(OFFLOAD + ["--save", str(tmp_path), "--save-interval", "2"], steps=2)
    t.save()
    t.close()
    t, resumed = _run(["--load", str(tmp_path)], steps=2)
    t.close()
    for a, b in zip(straight[2:], resumed):
        assert abs(a - b) <= 1e-4 * abs(a), (straight, resumed)

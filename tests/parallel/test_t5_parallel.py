"""T5 under torchrun on gloo: TP2 + SP and DP2 + the distributed optimizer give the losses and, after 3 steps,
the parameters of the one-process run (within 1e-5); the TP2 checkpoint resumes on one process with the loss the
one-process run has at that step (resharding). TP2 without SP: tests/parallel/test_t5_tp.py (logits, in-process)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bert_helpers import bert_data  # noqa: E402

from paratron.checkpoint.convert import read_checkpoint  # noqa: E402
from tests.parallel.cli import run_pretrain  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    work = tmp_path_factory.mktemp("t5data")
    prefix, vocab = bert_data(work, docs=120, vocab_size=160)
    return ["--encoder-num-layers", "2", "--decoder-num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--kv-channels", "8", "--ffn-hidden-size", "64", "--encoder-seq-length",
            "32", "--decoder-seq-length", "16", "--max-position-embeddings", "32", "--position-embedding-type",
            "relative", "--relative-attention-num-buckets", "8", "--normalization", "RMSNorm", "--geglu",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-style", "constant", "--vocab-extra-ids", "10", "--data-path", prefix,
            "--vocab-file", vocab, "--split", "98,1,1", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "1", "--data-cache-path", str(work / "cache"), "--adam-eps", "1e-6"]


def run(nproc, flags, save, *extra, iters=3):
    return run_pretrain(nproc, flags + ["--train-iters", str(iters), "--save", str(save), *extra], iters=iters,
                        script="pretrain_t5.py")


@pytest.fixture(scope="module")
def single(flags, tmp_path_factory):
    save = tmp_path_factory.mktemp("t5single")
    losses = run(1, flags, save, "--save-interval", "3", iters=4)
    return losses, read_checkpoint(save, iteration=3)[3]


@pytest.mark.parametrize("extra", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                   ["--use-distributed-optimizer"]], ids=["tp2-sp", "dp2-distopt"])
def test_layout_matches_one_process(flags, single, tmp_path, extra):
    losses = run(2, flags, tmp_path, *extra)
    want, params = single
    assert losses == pytest.approx(want[:3], rel=1e-5, abs=1e-5)
    got = read_checkpoint(tmp_path)[3]
    assert sorted(got) == sorted(params)
    for name, t in params.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-5, msg=name)
    if "--sequence-parallel" in extra:  # the TP2 checkpoint resumes on one process: resharded
        resumed = run_pretrain(1, flags + ["--train-iters", "4", "--load", str(tmp_path),
                                           "--use-checkpoint-opt_param-scheduler"], iters=1, script="pretrain_t5.py")
        assert resumed[0] == pytest.approx(want[3], rel=1e-5)

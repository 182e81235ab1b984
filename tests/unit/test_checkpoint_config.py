"""Resuming a checkpoint of another model is one error naming every differing field with both
values (paratron/checkpoint/compat.py), raised before any tensor is read, also where the tensors
would fit; --override-checkpoint-model-args loads it on purpose."""
import pytest
import torch

from paratron.checkpoint.compat import model_differences
from paratron.checkpoint.sharded import CheckpointError
from paratron.config import parse_args
from paratron.train.loop import Trainer

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--lr", "1e-3",
        "--num-workers", "0", "--eval-iters", "0", "--train-iters", "1", "--make-vocab-size-divisible-by", "64"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckcfg") / "ck"
    t = Trainer(parse_args(TINY + ["--save", str(root)]), data=(iter(()), None))
    t.save()
    t.close()
    return root


def load(root, *flags):
    return Trainer(parse_args(TINY + list(flags) + ["--load", str(root)]), data=(iter(()), None))


@pytest.mark.parametrize("flags,needles", [
    (["--num-layers", "1"], ["--num-layers 2 in the checkpoint vs 1 here"]),
    (["--num-attention-heads", "8"],  # the same QKV and projection shapes: only the config tells
     ["--num-attention-heads 4 in the checkpoint vs 8 here", "--kv-channels 16 in the checkpoint vs 8 here"]),
    (["--vocab-size", "200"], ["--vocab-size 256 in the checkpoint vs 200 here"]),  # same padded table (256)
    (["--vocab-size", "300"], ["--vocab-size 256 in the checkpoint vs 300 here"]),
    (["--position-embedding-type", "rope"],
     ["--position-embedding-type learned_absolute in the checkpoint vs rope here"]),
    (["--normalization", "RMSNorm"], ["--normalization LayerNorm in the checkpoint vs RMSNorm here"]),
    (["--swiglu", "--disable-bias-linear"], ["--swiglu false in the checkpoint vs true here",
                                             "--disable-bias-linear false in the checkpoint vs true here"]),
])
def test_another_model_is_one_error_naming_each_field(saved, flags, needles):
    with pytest.raises(CheckpointError) as e:
        load(saved, *flags)
    msg = str(e.value)
    assert "\n" not in msg and "was saved by another model" in msg and "--override-checkpoint-model-args" in msg
    for needle in needles:
        assert needle in msg, msg


def test_the_same_model_in_another_form_loads(saved, capsys):
    """What does not change the model's function is not compared: dropout, sequence length, the padding multiple."""
    load(saved, "--hidden-dropout", "0.3", "--seq-length", "16", "--make-vocab-size-divisible-by", "128")
    assert "resumed from" in capsys.readouterr().out


def test_override_flag_loads_on_purpose_when_the_tensors_fit(saved, capsys):
    ref = load(saved).model.module.state_dict()
    t = load(saved, "--num-attention-heads", "8", "--override-checkpoint-model-args")
    out = capsys.readouterr().out
    assert "WARNING" in out and "--num-attention-heads 4 in the checkpoint vs 8 here" in out
    got = t.model.module.state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref)  # the weights are the checkpoint's
    with pytest.raises(CheckpointError, match="does not fit this model"):  # shapes are still checked
        load(saved, "--hidden-size", "128", "--override-checkpoint-model-args")


def test_rope_settings_are_compared_only_for_rope_models():
    a = parse_args(TINY + ["--position-embedding-type", "rope"]).to_dict()
    b = parse_args(TINY + ["--position-embedding-type", "rope", "--rotary-base", "500000"])
    assert model_differences(a, b) == [("rotary_base", 10000.0, 500000.0)]
    learned = parse_args(TINY).to_dict()
    assert model_differences(learned, parse_args(TINY + ["--rotary-base", "500000"])) == []

"""`paratron train --model bert` end to end on a tiny sentence dataset: it trains and saves; the checkpoint fills
masks (`paratron fill-mask`), converts to Hugging Face's MegatronBertForPreTraining with the same logits and back;
BERT's bad input is a one-line error before step 1 (a GPT checkpoint loaded as BERT, CP, GPT-only flags)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bert_helpers import bert_data  # noqa: E402

from paratron.cli import main  # noqa: E402
from paratron.config import ConfigError, parse_args  # noqa: E402

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bert_train")
    prefix, vocab = bert_data(tmp)
    data = ["--data-path", prefix, "--vocab-file", vocab, "--split", "98,2,0"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", "--model", "bert", *TINY, *data, "--train-iters", "2", "--save", str(tmp / "ckpt")]) == 0
    lines = [ln for ln in out.getvalue().splitlines() if "iteration        2/" in ln]
    assert lines and "| lm loss: " in lines[0] and "| sop loss: " in lines[0], out.getvalue()[-2000:]
    return tmp, data


@pytest.mark.slow
def test_fill_mask_and_hf_round_trip(trained, capsys):
    tmp, data = trained
    ckpt = str(tmp / "ckpt")
    capsys.readouterr()
    assert main(["fill-mask", "--load", ckpt, "--text", "The [MASK] value is [MASK].", "--top-k", "3", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [len(m["tokens"]) for m in answer["masks"]] == [3, 3] and answer["masks"][0]["position"] == 2
    assert all(m["probs"] == sorted(m["probs"], reverse=True) for m in answer["masks"])
    transformers = pytest.importorskip("transformers")
    assert main(["convert", "--to", "hf", "--load", ckpt, "--output", str(tmp / "hf"), "--quiet"]) == 0
    assert (tmp / "hf" / "vocab.txt").is_file()
    hf = transformers.MegatronBertForPreTraining.from_pretrained(str(tmp / "hf")).eval()
    from paratron.inference.fill_mask import FillMask
    fm = FillMask.load(ckpt)
    ids = torch.tensor([fm.ids("The [MASK] value is [MASK].")])
    with torch.no_grad():
        want = hf(input_ids=ids, token_type_ids=torch.zeros_like(ids))
        got, binary = fm.model(ids, padding_mask=torch.ones_like(ids), tokentype_ids=torch.zeros_like(ids))
    torch.testing.assert_close(got[..., :fm.vocab], want.prediction_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(binary, want.seq_relationship_logits, atol=1e-5, rtol=1e-5)
    assert main(["convert", "--from", "hf", "--input", str(tmp / "hf"), "--save", str(tmp / "back"), "--quiet"]) == 0
    back = FillMask.load(tmp / "back")
    assert back.predict("The [MASK] value.", 2)[0].ids == fm.predict("The [MASK] value.", 2)[0].ids


@pytest.mark.slow
def test_gpt_checkpoint_loaded_as_bert_is_one_line(trained, tmp_path, capsys):
    tmp, data = trained
    gpt = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
           "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--train-iters", "1",
           "--eval-iters", "0", "--num-workers", "0", "--device", "cpu", "--save", str(tmp_path / "gpt")]
    assert main(["train", *gpt]) == 0
    capsys.readouterr()
    code = main(["train", "--model", "bert", *TINY, *data, "--train-iters", "2", "--load", str(tmp_path / "gpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "holds a GPT model (--model gpt)" in err[0], err
    code = main(["generate", "--load", str(tmp / "ckpt"), "--prompt", "x"])
    assert code == 2 and "fill-mask" in capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    (["--model", "bert", "--context-parallel-size", "2"], "--context-parallel-size > 1"),
    (["--model", "bert", "--bert-embedder-type", "huggingface"], "--bert-embedder-type huggingface"),
    (["--bert-no-binary-head"], "read only by BERT"),
    (["--model", "bert", "--mock-data"], "--mock-data"),
    (["--model", "t6"], "--model t6"),
])
def test_bert_refusals(flags, needle, tmp_path):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-3"]
    data = [] if "--mock-data" in flags else ["--data-path", "x", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                               "64"]
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+")):
        parse_args(base + data + flags, world_size=2)

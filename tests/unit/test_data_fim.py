"""Fill-in-the-middle samples (--fim-data, paratron/data/fim.py): the rewrite on a character-level
tokenizer whose results can be checked by hand, and the whole path (preprocessed data, a HuggingFace
tokenizer.json with FIM tokens, the dataset builder) on a tiny corpus."""
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from data_helpers import build_datasets, data_args, small_corpus, train_tiny_bpe  # noqa: E402

from paratron.data.errors import DataError  # noqa: E402
from paratron.data.fim import FIMTransform  # noqa: E402

SPECIAL = {"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<fim_pad>": 4, "<|endoftext|>": 5, "<file>": 6}
PRE, MID, SUF, PAD, EOD, FILE = 1, 2, 3, 4, 5, 6


class CharTokenizer:
    """One id per character (its code point + 100) and the special tokens above."""

    def token_id(self, token):
        return SPECIAL.get(token)

    def text_of(self, ids):
        return "".join(chr(i - 100) for i in ids if i >= 100)

    def ids_of(self, text):
        return [ord(c) + 100 for c in text]


def ids(text):
    return np.array(CharTokenizer().ids_of(text), dtype=np.int64)


def fim(**kw):
    data = dict(fim_rate=1.0, fim_spm_rate=0.0, fim_fragment_rate=None, fim_no_prefix=None, fim_split_sample=None,
                fim_prefix_token="<fim_prefix>", fim_middle_token="<fim_middle>", fim_suffix_token="<fim_suffix>",
                fim_pad_token="<fim_pad>", fim_eod_token="<|endoftext|>")
    data.update(kw)
    return FIMTransform(SimpleNamespace(**data), CharTokenizer(), seed=1234)


def rng(i=0):
    return np.random.default_rng([1234, 0, i])


def undo_psm(tokens):
    """prefix + middle + suffix of one PSM document: <pre> P <suf> S <mid> M."""
    t = list(tokens)
    assert t[0] == PRE and t.count(SUF) == 1 and t.count(MID) == 1
    p, s, m = t[1:t.index(SUF)], t[t.index(SUF) + 1:t.index(MID)], t[t.index(MID) + 1:]
    return CharTokenizer().text_of(p + m + s)


def test_psm_spm_and_untouched():
    doc = np.concatenate([ids("def add(a, b): return a + b"), [EOD], ids("x = 1")])
    assert np.array_equal(fim(fim_rate=0.0)(doc, rng()), doc)  # rate 0: as read
    one = fim()._document(ids("def add(a, b): return a + b"), rng())  # a document, before the cut to length
    assert undo_psm(one) == "def add(a, b): return a + b"  # the same text, PSM order
    t = list(fim(fim_spm_rate=1.0)._document(ids("hello world"), rng(3)))
    assert t[:2] == [PRE, SUF] and t.count(MID) == 1  # SPM: <pre> <suf> S <mid> P M
    s, pm = t[2:t.index(MID)], t[t.index(MID) + 1:]
    assert CharTokenizer().text_of(pm + s) == "hello world"
    out = fim()(doc, rng())  # a sample: each document rewritten, the EOD between them kept, cut to length
    assert len(out) == len(doc) and out[0] == PRE and EOD in out
    assert undo_psm(out[:list(out).index(EOD)]) == "def add(a, b): return a + b"


def test_same_sample_same_rewrite():
    doc = ids("for i in range(10): print(i)")
    a, b = fim()(doc, rng(7)), fim()(doc, rng(7))
    assert np.array_equal(a, b)
    assert any(not np.array_equal(fim()(doc, rng(7)), fim()(doc, rng(k))) for k in range(8, 20))
    short = np.concatenate([ids("ab"), [EOD], [EOD], [EOD], ids("c")])  # empty documents keep their EODs
    out = fim(fim_rate=0.0)(short, rng())
    assert list(out) == list(short)


def test_no_prefix_and_split_sample():
    doc = np.concatenate([ids("#skip this"), [EOD], ids("keep")])
    out = fim(fim_no_prefix="#skip")(doc, rng())
    assert list(out[:len(ids("#skip this")) + 1]) == list(ids("#skip this")) + [EOD]
    assert out[len(ids("#skip this")) + 1] == PRE  # the other document is rewritten
    repo = np.concatenate([ids("aaaa"), [FILE], ids("bbbb"), [FILE], ids("cc")])
    out = fim(fim_split_sample="<file>", fim_fragment_rate=1.0)._document(repo, rng())
    parts = np.split(out, np.flatnonzero(out == FILE))
    assert len(parts) == 3  # the split tokens kept, each fragment rewritten on its own
    assert [undo_psm(parts[0]), undo_psm(parts[1][1:]), undo_psm(parts[2][1:])] == ["aaaa", "bbbb", "cc"]
    untouched = fim(fim_split_sample="<file>", fim_fragment_rate=0.0)(repo, rng())
    assert list(untouched) == list(repo)
    shorter = np.concatenate([[FILE] * 5, ids("ab")])  # special tokens inside a document are not text:
    out = fim()(shorter, rng())  # its rewrite is shorter, so the sample is padded
    assert len(out) == 7 and list(out[-2:]) == [PAD, PAD] and undo_psm(out[:5]) == "ab"


def test_missing_tokens_name_the_flags():
    with pytest.raises(DataError, match=r"no single token for <fim_pad_x> \(--fim-pad-token\)"):
        fim(fim_pad_token="<fim_pad_x>")
    with pytest.raises(DataError, match="--fim-split-sample '<dir>' is not one token"):
        fim(fim_split_sample="<dir>", fim_fragment_rate=0.5)


def test_fim_dataset_end_to_end(tmp_path):
    """A HuggingFace tokenizer.json with FIM tokens, a preprocessed corpus, the builder: samples hold
    the sentinels, keep their length, and FIM pad positions carry no loss."""
    from tokenizers import Tokenizer as RustTokenizer

    from paratron.data.indexed import write_dataset
    from paratron.data.tokenizers import HuggingFaceTokenizer
    path = train_tiny_bpe(str(tmp_path))
    rust = RustTokenizer.from_file(path)
    rust.add_special_tokens(["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"])
    rust.save(path)
    tok = HuggingFaceTokenizer(path)
    texts = [line for line in open(small_corpus(str(tmp_path / "c.jsonl"), 60)).read().splitlines()]
    docs = [np.array(tok.tokenize(t[10:-2]) + [tok.eod], dtype=np.int64) for t in texts]
    write_dataset(str(tmp_path / "code"), docs)
    cfg = data_args(data_path=[str(tmp_path / "code")], fim_data=True, fim_rate=1.0, seq_length=64,
                    split="100,0,0")
    train, _, _ = build_datasets(cfg, tok)
    ids_of = {name: tok.token_id(name) for name in ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")}
    seen = set()
    for i in range(8):
        s = train[i]
        assert s["tokens"].shape == (64,) and s["labels"].shape == (64,)
        seen.update(int(t) for t in s["tokens"])
        assert bool((s["loss_mask"][s["labels"] == ids_of["<fim_pad>"]] == 0).all())
        assert torch.equal(train[i]["tokens"], s["tokens"])  # the same sample, rewritten the same way
    assert ids_of["<fim_prefix>"] in seen and ids_of["<fim_middle>"] in seen and ids_of["<fim_suffix>"] in seen

"""BERT data: the sentence splitter of preprocess --split-sentences, the sample index and whole samples equal to
megatron-core 0.16.1's BERTMaskedWordPieceDataset, masking by hand."""
from __future__ import annotations

import os
import sys
import types
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bert_helpers import bert_data  # noqa: E402

from paratron.data.bert_dataset import BertDataConfig, BertDataset  # noqa: E402
from paratron.data.bert_indices import MT64, build_mapping  # noqa: E402
from paratron.data.indexed import IndexedDataset  # noqa: E402
from paratron.data.masking import MaskingConfig, bert_replacement, candidates_of, mask_tokens  # noqa: E402
from paratron.data.sentences import split_sentences  # noqa: E402
from paratron.data.wordpiece import BertWordPieceTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix, vocab = bert_data(tmp_path_factory.mktemp("bert"))
    return IndexedDataset(prefix), BertWordPieceTokenizer(vocab, True), prefix


def test_sentence_splitter():
    text = "Hello world. Mr. Smith paid 3.14 dollars! Did J. R. R. Tolkien write it? Yes. e.g. this stays"
    assert split_sentences(text) == ["Hello world.", "Mr. Smith paid 3.14 dollars!",
                                     "Did J. R. R. Tolkien write it?", "Yes. e.g. this stays"]
    assert split_sentences('He said "Stop." Then left.') == ['He said "Stop."', "Then left."]
    assert split_sentences("One.\nTwo.", keep_newlines=True) == ["One.\n", "Two."]
    assert split_sentences("no capital. after this") == ["no capital. after this"]


def test_preprocess_split_sentences_makes_documents_of_sentences(data):
    ds, tok, prefix = data
    assert prefix.endswith("_text_sentence") and ds.num_documents == 120 and len(ds) > 2 * ds.num_documents
    first = [tok._tokens[i] for i in ds[0]]
    assert first[-1] in (".", "!", "?") and "." not in first[:-1]  # one sentence per sequence


def test_mt19937_64_first_outputs():
    gen = MT64(5489)  # C++'s default seed: the standard's 10000th output is 9981545732273789042
    for _ in range(9999):
        gen()
    assert gen() == 9981545732273789042


def _mcore():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import bert_dataset, helpers_cpp, indexed_dataset
            from megatron.core.datasets.utils import Split
    except Exception:
        pytest.skip("megatron-core (the test extra) cannot be imported")
    return types.SimpleNamespace(bert=bert_dataset, helpers=helpers_cpp, indexed=indexed_dataset, Split=Split)


@pytest.mark.parametrize("seed,prob,min_sent,samples", [(1234, 0.1, 2, 700), (7, 0.0, 1, 50), (99, 0.5, 2, 3000)])
def test_sample_index_equals_megatron_core(data, seed, prob, min_sent, samples):
    mc = _mcore()
    ds = data[0]
    docs = ds.document_indices[np.arange(10, 101)]  # documents 10..99 and the end of 99
    want = mc.helpers.build_mapping(docs, ds.sequence_lengths, np.iinfo(np.int32).max - 1, samples, 61, prob, seed,
                                    False, min_sent)
    got = build_mapping(docs, ds.sequence_lengths, samples, 61, prob, seed, min_sent)
    assert got.dtype == want.dtype and np.array_equal(got, want)


class _MegatronTokenizer:
    """What megatron-core's BERT dataset reads of a tokenizer, from paratron's."""

    def __init__(self, tok):
        self.cls, self.sep, self.mask, self.pad, self.eod = tok.cls, tok.sep, tok.mask, tok.pad, tok.eod
        self.inv_vocab = tok.inv_vocab
        self.unique_identifiers = {"class": "wordpiece", "vocab": len(tok.inv_vocab)}
        self.special_tokens_dict = {"cls_token": tok.cls, "sep_token": tok.sep, "mask_token": tok.mask,
                                    "pad_token": tok.pad}


@pytest.mark.parametrize("binary_head", [True, False])
def test_samples_equal_megatron_core(data, monkeypatch, tmp_path, binary_head):
    mc = _mcore()
    ds, tok, prefix = data
    import torch.distributed
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    config = mc.bert.BERTMaskedWordPieceDatasetConfig(
        random_seed=1234, sequence_length=48, blend=([prefix], None), split="90,10,0", path_to_cache=str(tmp_path),
        tokenizer=_MegatronTokenizer(tok), masking_probability=0.15, short_sequence_probability=0.1,
        masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False, classification_head=binary_head)
    docs = np.arange(0, 108)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = mc.bert.BERTMaskedWordPieceDataset(mc.indexed.IndexedDataset(prefix), prefix, docs, 400,
                                                   mc.Split.train, config)
    mine = BertDataset(ds, prefix, docs, 400, "train", BertDataConfig(48, 1234, binary_head=binary_head), tok)
    assert np.array_equal(np.asarray(want.sample_index), mine.sample_index)
    for i in range(0, len(mine), 7):
        a, b = want[i], mine[i]
        for key in ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated"):
            assert np.array_equal(np.asarray(a[key]), b[key].numpy()), (i, key)


def test_masking_by_hand():
    # tokens: [CLS] w1 w2 ##a ##b w3 [SEP]  (ids 1, 10, 11, 90, 91, 12, 2; ids >= 90 continue a word)
    tokens = [1, 10, 11, 90, 91, 12, 2]
    cands = candidates_of(tokens, (1, 2), lambda t: t >= 90, whole_word=True)
    assert cands == [[1], [2, 3, 4], [5]]
    assert candidates_of(tokens, (1, 2), lambda t: t >= 90, whole_word=False) == [[1], [2], [3], [4], [5]]
    cfg = MaskingConfig(probability=0.5, max_ngram=1)
    out, pos, labels, spans = mask_tokens(tokens, 7, cfg, cands, lambda rng: 4, np.random.RandomState(0))
    # budget min(0.5 * 7, round(7 * 0.5) = 4) = 3.5 tokens: whole words only, never a piece alone
    assert sum(len(p) for p, _ in spans) == len(pos) <= 3.5 and labels == [tokens[i] for i in pos]
    assert all(out[i] == 4 for i in pos) and all(out[i] == tokens[i] for i in range(7) if i not in pos)
    assert ({2, 3, 4} <= set(pos)) or not ({2, 3, 4} & set(pos))
    rng, replace = np.random.RandomState(3), bert_replacement(4, list(range(100)))
    draws = [replace(rng) for _ in range(20000)]
    kept, masked = sum(d is None for d in draws) / 2e4, sum(d == 4 for d in draws) / 2e4
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01  # and 10 % random ids


def test_sample_shape_and_masks(data):
    ds, tok, prefix = data
    mine = BertDataset(ds, None, np.arange(0, 50), 30, "train", BertDataConfig(40, 5), tok)
    masked = 0
    for i in range(len(mine)):
        s = mine[i]
        real = s["padding_mask"].numpy() == 1
        n = int(real.sum())
        assert s["text"][0] == tok.cls and s["text"][n - 1] == tok.sep and real[:n].all() and not real[n:].any()
        assert (s["labels"].numpy() >= 0).tolist() == s["loss_mask"].numpy().astype(bool).tolist()
        assert int(s["loss_mask"].sum()) <= max(1, round(n * 0.15))  # (a short target may mask none)
        masked += int(s["loss_mask"].sum())
        types = s["types"].numpy()[:n]
        assert types[0] == 0 and types[-1] == 1 and np.all(np.diff(types) >= 0)  # A then B
    assert masked > len(mine)

"""T5Dataset: span corruption by hand on a small corpus, and the samples of megatron-core 0.16.1's
T5MaskedWordPieceDataset for the same seed."""
import numpy as np
import pytest
import torch

from paratron.data.errors import DataError
from paratron.data.indexed import IndexedDataset, write_dataset
from paratron.data.masking import MaskingConfig, mask_tokens
from paratron.data.t5_dataset import SpanVocab, T5DataConfig, T5Dataset

SENTINELS = tuple(range(90, 100))


class WordPiece:
    """A vocabulary of 100 ids: 0 [PAD], 1 [CLS], 2 [SEP], 3 [MASK], 4 [BOS], 5 [EOS], ids 6..49 words,
    50..89 ``##`` pieces, 90..99 <extra_id_0..9>."""
    cls, sep, mask, bos, eos, pad = 1, 2, 3, 4, 5, 0
    additional_special_tokens_ids = list(SENTINELS)
    inv_vocab = {i: (f"##p{i}" if 50 <= i < 90 else f"w{i}") for i in range(100)}
    vocab = {v: k for k, v in inv_vocab.items()}
    vocab_size = 100
    unique_identifiers = {"class": "WordPiece"}

    def token_id(self, text):
        return SENTINELS[int(text[len("<extra_id_"):-1])] if text.startswith("<extra_id_") else None


def test_spans_by_hand():
    """Whole words only, the budget respected, each span's labels its original tokens."""
    tokens = [6, 50, 51, 7, 8, 52, 9, 10, 11, 53, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    words = [[0, 1, 2], [3], [4, 5], [6], [7], [8, 9]] + [[i] for i in range(10, 20)]
    cfg = MaskingConfig(probability=0.3, max_ngram=10, geometric=True)
    out, _, _, spans = mask_tokens(tokens, 20, cfg, words, lambda _: 3, np.random.RandomState(3))
    masked = [p for positions, _ in spans for p in positions]
    assert 0 < len(masked) <= 6 and len(set(masked)) == len(masked)
    for positions, labels in spans:
        assert labels == [tokens[p] for p in positions] and all(out[p] == 3 for p in positions)
        starts = [w[0] for w in words]
        assert positions[0] in starts and positions[-1] + 1 in starts + [len(tokens)]  # whole words


def test_assemble_by_hand():
    vocab = SpanVocab(SENTINELS, bos=4, eos=5, pad=0)
    ds = T5Dataset(None, np.arange(1), 1, T5DataConfig(1, 12, 8), vocab, sample_index=np.zeros((1, 3), np.int64))
    s = ds.assemble([11, 12, 13, 14, 15, 16], [([1, 2], [12, 13]), ([4], [15])], False)
    assert s["text_enc"].tolist() == [11, 90, 14, 91, 16] + [0] * 7
    assert s["text_dec"].tolist() == [4, 90, 12, 13, 91, 15, 0, 0]
    assert s["labels"].tolist() == [90, 12, 13, 91, 15, 5, -1, -1]  # (Megatron: -1 past the end, unless pad is -1)
    assert s["loss_mask"].tolist() == [1] * 6 + [0, 0] and s["enc_mask"].tolist() == [1] * 5 + [0] * 7


def test_missing_sentinels_one_line():
    class NoSentinels(WordPiece):
        def token_id(self, text):
            return None
    with pytest.raises(DataError, match="--vocab-extra-ids"):
        SpanVocab.of(NoSentinels(), 10)


def corpus(tmp_path):
    rng = np.random.RandomState(0)
    docs = []
    for _ in range(40):
        sentences = [list(rng.randint(6, 90, size=rng.randint(3, 25))) for _ in range(rng.randint(1, 6))]
        docs.append(sentences)
    prefix = str(tmp_path / "c")
    from paratron.data.indexed import IndexedDatasetWriter
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for sentences in docs:
            w.add_document([t for s in sentences for t in s], lengths=[len(s) for s in sentences])
    return prefix


@pytest.fixture
def gloo_one_rank(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_samples_equal_megatron_core(tmp_path, gloo_one_rank):
    mc = pytest.importorskip("megatron.core.datasets.t5_dataset")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MCIndexed
    from megatron.core.datasets.utils import Split
    prefix = corpus(tmp_path)
    config = mc.T5MaskedWordPieceDatasetConfig(
        random_seed=1234, sequence_length=48, sequence_length_decoder=24, split="1,0,0", path_to_cache=str(tmp_path),
        tokenizer=WordPiece(), masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=10,
        masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True, blend=([prefix], None))
    docs = np.arange(3, 37)
    theirs = mc.T5MaskedWordPieceDataset(MCIndexed(prefix), prefix, docs, 120, Split.train, config)
    ours = T5Dataset(IndexedDataset(prefix), docs, 120, T5DataConfig(1234, 48, 24, 0.15, 0.1),
                     SpanVocab.of(WordPiece(), 10))
    np.testing.assert_array_equal(ours.sample_index, np.asarray(theirs.sample_index))
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        for key in b:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=f"sample {i} {key}")

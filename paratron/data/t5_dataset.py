"""T5Dataset: Megatron's span corruption over an indexed dataset (megatron-core's T5MaskedWordPieceDataset, the
same samples for the same seed).

A sample is a run of whole sentences of one document (data/bert_indices.py ``build_mapping``; made with
``--split-sentences`` a document has many, else one) cut to a target length of ``--encoder-seq-length`` - 2 (or
shorter with ``--short-seq-prob``). About ``--mask-prob`` of its tokens are masked in spans of whole words whose
length is drawn from a geometric distribution (p 0.2, at most 10: Megatron's T5 settings; the mean span is a few
words). Each span is replaced in the encoder's input by the next sentinel (``<extra_id_0>``, ``<extra_id_1>``, ...,
``--vocab-extra-ids`` of them in the tokenizer); the decoder reads ``[BOS] sentinel span sentinel span ...`` and
predicts ``sentinel span sentinel span ... [EOS]``. Each sample draws from its own ``RandomState(seed + index)``.

Sample keys (Megatron's): ``text_enc`` [se], ``text_dec`` / ``labels`` / ``loss_mask`` [sd], ``enc_mask`` /
``dec_mask`` (1 = a real token), ``truncated``.
"""
from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .bert_indices import build_mapping
from .errors import DataError
from .gpt_dataset import cached_build
from .masking import MaskingConfig, candidates_of, mask_tokens

PAD_FALLBACK = -1  # Megatron's pad id when the tokenizer's is missing or is also its EOS / EOD


@dataclass(frozen=True)
class SpanVocab:
    """What span corruption needs of a tokenizer. ``continuation``: ids of WordPiece ``##`` pieces."""
    sentinels: tuple
    bos: int
    eos: int
    pad: int = PAD_FALLBACK
    mask: Optional[int] = None
    boundaries: frozenset = frozenset()  # [CLS], [SEP]: never masked
    continuation: frozenset = field(default=frozenset(), repr=False)

    @classmethod
    def of(cls, tokenizer, vocab_extra_ids: int) -> "SpanVocab":
        """From a paratron (or Megatron) tokenizer: ``<extra_id_i>`` sentinels, BOS / EOS, pad, [CLS] / [SEP] and
        the ``##`` pieces of its vocabulary (``inv_vocab``) where it has them."""
        ids = [_token(tokenizer, f"<extra_id_{i}>") for i in range(vocab_extra_ids)]
        if vocab_extra_ids < 1 or None in ids:
            first = "<extra_id_0>" if vocab_extra_ids < 1 else f"<extra_id_{ids.index(None)}>"
            raise DataError(f"T5 span corruption needs the sentinels <extra_id_0>..<extra_id_N-1> (--vocab-extra-ids "
                            f"N, here {vocab_extra_ids}) in the tokenizer, and {type(tokenizer).__name__} has no "
                            f"{first}: use a tokenizer that adds them (BertWordPieceLowerCase / BertWordPieceCase, "
                            "SentencePieceTokenizer) or one whose vocabulary has them")
        bos = _special(tokenizer, "bos", ("[BOS]", "<BOS>", "<s>"))
        eos = _special(tokenizer, "eos", ("[EOS]", "<EOS>", "</s>"))
        if bos is None or eos is None:
            raise DataError(f"T5 span corruption needs BOS and EOS tokens; {type(tokenizer).__name__} has "
                            f"{'no BOS' if bos is None else 'no EOS'}")
        pad = getattr(tokenizer, "pad", None)
        if pad is None or pad in (eos, getattr(tokenizer, "eod", None)):
            pad = PAD_FALLBACK
        inv = getattr(tokenizer, "inv_vocab", None) or {}
        return cls(tuple(ids), bos, eos, pad, _special(tokenizer, "mask", ("[MASK]", "<MASK>")),
                   frozenset(t for t in (_special(tokenizer, "cls", ("[CLS]", "<CLS>")),
                                         _special(tokenizer, "sep", ("[SEP]", "<SEP>"))) if t is not None),
                   frozenset(i for i, piece in inv.items() if str(piece).startswith("##")))


def _token(tokenizer, text: str) -> Optional[int]:
    finder = getattr(tokenizer, "token_id", None)
    found = finder(text) if finder is not None else None
    return found if found is not None else getattr(tokenizer, "vocab", {}).get(text)


def _special(tokenizer, attr: str, names) -> Optional[int]:
    try:
        value = getattr(tokenizer, attr, None)
    except (AttributeError, NotImplementedError):
        value = None
    if value is not None:
        return int(value)
    for name in names:
        found = _token(tokenizer, name)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class T5DataConfig:
    seed: int
    encoder_seq_length: int
    decoder_seq_length: int
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    vocab_extra_ids: int = 100
    data_cache_path: Optional[str] = None
    split: Optional[str] = None
    mmap_bin_files: bool = True

    @classmethod
    def from_config(cls, data, model, seed: int) -> "T5DataConfig":
        """From the run's data and model sections."""
        return cls(int(seed), int(model.encoder_seq_length), int(model.decoder_seq_length), float(data.mask_prob),
                   float(data.short_seq_prob), int(data.vocab_extra_ids), data.data_cache_path, data.split,
                   not data.no_mmap_bin_files)

    @property
    def masking(self) -> MaskingConfig:
        """Megatron's T5 masking (pretrain_t5.py): N-grams of up to 10 whole words, N geometric, no permutation."""
        return MaskingConfig(probability=self.mask_prob, max_ngram=10, whole_word=True, geometric=True)


class T5Dataset(torch.utils.data.Dataset):
    """``documents``: the split's document numbers (contiguous); ``num_samples`` None: one epoch. The sample index
    is cached as the BERT dataset's (``--data-cache-path``) when ``path_prefix`` or a cache path is given."""

    kind = "T5MaskedWordPieceDataset"

    def __init__(self, indexed, documents: np.ndarray, num_samples: Optional[int], config: T5DataConfig,
                 vocab: SpanVocab, sample_index: Optional[np.ndarray] = None, path_prefix: Optional[str] = None,
                 split_name: str = "train", allow_build: bool = True):
        self.indexed, self.config, self.vocab, self.masking = indexed, config, vocab, config.masking
        if sample_index is None:  # one [BOS] and one [EOS] besides the sample's tokens
            docs = np.asarray(indexed.document_indices)[np.append(documents, documents[-1] + 1)]
            description = json.dumps({
                "class": self.kind, "dataset_path": path_prefix, "num_samples": num_samples, "split": config.split,
                "index_split": split_name, "random_seed": config.seed, "sequence_length": config.encoder_seq_length,
                "short_sequence_probability": config.short_seq_prob,
                "documents": [int(documents[0]), int(documents[-1]) + 1]}, indent=4)
            cache = config.data_cache_path or (os.path.join(path_prefix, "cache", f"{self.kind}_indices")
                                               if path_prefix else None)
            (sample_index,) = cached_build(cache, description, self.kind, split_name, ("sample_index",), lambda: (
                build_mapping(docs, np.asarray(indexed.sequence_lengths), num_samples, config.encoder_seq_length - 2,
                              config.short_seq_prob, config.seed, 1),), allow_build)
        self.sample_index = sample_index

    def __len__(self) -> int:
        return len(self.sample_index)

    def __getitem__(self, idx: int) -> dict:
        first, end, target = (int(x) for x in self.sample_index[idx])
        rng = np.random.RandomState(seed=(self.config.seed + idx) % 2 ** 32)
        tokens = [int(t) for i in range(first, end) for t in self.indexed[i]]
        truncated = len(tokens) > target
        tokens = tokens[:target]
        v = self.vocab
        words = candidates_of(tokens, v.boundaries, v.continuation.__contains__, self.masking.whole_word)
        tokens, _, _, spans = mask_tokens(tokens, target, self.masking, words, lambda _: v.mask, rng)
        return self.assemble(tokens, spans, truncated)

    def assemble(self, tokens: list, spans: list, truncated: bool) -> dict:
        """The encoder input with each span replaced by its sentinel, the decoder's input and labels, padded."""
        v, c = self.vocab, self.config
        if len(spans) > len(v.sentinels):
            raise DataError(f"a sample has {len(spans)} masked spans but the tokenizer only {len(v.sentinels)} "
                            "sentinels: raise --vocab-extra-ids")
        sentinels = deque(v.sentinels)
        enc, dec_in, dec_out, start = [], [v.bos], [], 0
        for positions, labels in spans:
            sentinel = sentinels.popleft()
            enc.extend(tokens[start:positions[0]])
            enc.append(sentinel)
            dec_in.extend([sentinel, *labels])
            dec_out.extend([sentinel, *labels])
            start = positions[-1] + 1
        enc.extend(tokens[start:])
        dec_out.append(v.eos)
        n_dec = len(dec_in)
        if len(enc) > c.encoder_seq_length or n_dec > c.decoder_seq_length:
            raise DataError(f"a T5 sample needs {len(enc)} encoder / {n_dec} decoder tokens, more than "
                            f"--encoder-seq-length {c.encoder_seq_length} / --decoder-seq-length "
                            f"{c.decoder_seq_length}: raise --decoder-seq-length")
        enc = np.pad(np.array(enc, dtype=np.int64), (0, c.encoder_seq_length - len(enc)), constant_values=v.pad)
        dec_in = np.pad(np.array(dec_in, dtype=np.int64), (0, c.decoder_seq_length - n_dec), constant_values=v.pad)
        labels = np.pad(np.array(dec_out, dtype=np.int64), (0, c.decoder_seq_length - n_dec), constant_values=-1)
        enc_mask, dec_mask = (enc != v.pad).astype(np.int64), (dec_in != v.pad).astype(np.int64)
        loss_mask = np.zeros(c.decoder_seq_length, dtype=np.int64)
        loss_mask[:n_dec] = 1
        for t in (enc, dec_in, labels):  # padding as a token id the embedding can look up
            t[t == v.pad] = 0
        return {"text_enc": enc, "text_dec": dec_in, "labels": labels, "loss_mask": loss_mask,
                "truncated": int(truncated), "enc_mask": enc_mask, "dec_mask": dec_mask}


def t5_builder(config: T5DataConfig, tokenizer):
    """``make_builder`` of ``build_train_valid_test_datasets`` for T5: splits over documents, as Megatron's masked
    datasets."""
    from .bert_dataset import document_builder  # (bert_dataset.py imports the data package as this one)
    vocab = SpanVocab.of(tokenizer, config.vocab_extra_ids)

    def make(indexed, prefix, documents, size, split_name, allow_build):
        return T5Dataset(indexed, documents, size, config, vocab, path_prefix=prefix, split_name=split_name,
                         allow_build=allow_build)
    return document_builder(make, config, tokenizer)

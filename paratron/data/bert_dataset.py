"""Megatron's BERT dataset (megatron-core's ``BERTMaskedWordPieceDataset``) over ``.bin/.idx`` files made with
``--split-sentences`` (one sequence per sentence, documents of sentences).

A split is a range of documents (``--split`` over the document count). Its samples are runs of sentences
(paratron/data/bert_indices.py: the same [n, 3] index as megatron-core's for the same inputs, cached as
``{cache}/{md5}-BERTMaskedWordPieceDataset-{split}-sample_index.npy``). Sample ``i`` draws from
``numpy.random.RandomState((seed + i) % 2**32)``, in Megatron's order:

1. with the binary head: the sentences are cut in two, A and B, at a random pivot (when there are 3 or more),
   and half the time swapped (``is_random`` = 1: sentence order prediction);
2. the longer of A and B loses a token from its front or back (a coin) until both fit the target length;
3. ``[CLS] A [SEP] (B [SEP])``, tokentypes 0 for A's part and 1 for B's;
4. masked-LM predictions (paratron/data/masking.py): 15 % (``--mask-prob``) of the tokens in whole words,
   n-grams of up to 3 words, each token 80 % [MASK], 10 % a random id, 10 % itself;
5. padded to ``--seq-length`` with [PAD]: ``padding_mask`` 1 at real tokens; ``labels`` the original ids at
   the masked positions and -1 elsewhere; ``loss_mask`` 1 at the masked positions.

The random replacement id is uniform over the vocabulary's ids, in id order (Megatron draws from its
tokenizer's ``inv_vocab`` keys: the same list for a vocab.txt read in order).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np
import torch

from paratron.data.bert_indices import build_mapping
from paratron.data.errors import DataError
from paratron.data.gpt_dataset import cached_build
from paratron.data.masking import MaskingConfig, bert_replacement, candidates_of, mask_tokens

NO_PAD = -1  # Megatron's pad id when the tokenizer's collides with another special token


@dataclass
class BertDataConfig:
    seq_length: int
    seed: int = 1234
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    binary_head: bool = True  # samples of two parts (at least two sentences) and a sentence-order label
    data_cache_path: Optional[str] = None
    split: Optional[str] = None
    mmap_bin_files: bool = True
    tokenizer_id: Dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_config(cls, data, model, tokenizer, seq_length: int, seed: int) -> "BertDataConfig":
        return cls(seq_length=int(seq_length), seed=int(seed), mask_prob=float(data.mask_prob),
                   short_seq_prob=float(data.short_seq_prob), binary_head=not model.bert_no_binary_head,
                   data_cache_path=data.data_cache_path, split=data.split,
                   mmap_bin_files=not data.no_mmap_bin_files,
                   tokenizer_id=dict(getattr(tokenizer, "unique_identifiers", {"class": "?"})))


def check_wordpiece(tokenizer) -> None:
    missing = [a for a in ("cls", "sep", "mask", "continues") if not hasattr(tokenizer, a)]
    if missing:
        raise DataError(f"BERT data needs a WordPiece tokenizer with [CLS], [SEP] and [MASK] (--tokenizer-type "
                        f"BertWordPieceLowerCase or BertWordPieceCase), not {type(tokenizer).__name__}")


class BertDataset(torch.utils.data.Dataset):
    """One split of one sentence-level indexed dataset; ``documents`` the split's document ids."""

    kind = "BERTMaskedWordPieceDataset"

    def __init__(self, indexed, path_prefix: Optional[str], documents: np.ndarray, num_samples: Optional[int],
                 split_name: str, config: BertDataConfig, tokenizer, allow_build: bool = True):
        check_wordpiece(tokenizer)
        self.dataset, self.config, self.tokenizer = indexed, config, tokenizer
        self.masking = MaskingConfig(probability=config.mask_prob, max_ngram=3, whole_word=True)
        pad = tokenizer.pad
        self.pad = NO_PAD if pad is None or pad in (tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.eod) \
            else int(pad)
        self.replace = bert_replacement(tokenizer.mask, list(range(tokenizer.vocab_size)))
        self.specials = (tokenizer.cls, tokenizer.sep)
        description = json.dumps({
            "class": self.kind, "dataset_path": path_prefix, "num_samples": num_samples, "index_split": split_name,
            "random_seed": config.seed, "sequence_length": config.seq_length, "split": config.split,
            "masking_probability": config.mask_prob, "short_sequence_probability": config.short_seq_prob,
            "classification_head": config.binary_head, "tokenizer": config.tokenizer_id,
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else []}, indent=4)
        docs = indexed.document_indices[np.append(documents, documents[-1] + 1)]
        cache = config.data_cache_path or (os.path.join(path_prefix, "cache", f"{self.kind}_indices")
                                           if path_prefix else None)
        (self.sample_index,) = cached_build(
            cache, description, self.kind, split_name, ("sample_index",),
            lambda: (build_mapping(docs, indexed.sequence_lengths, num_samples, config.seq_length - 3,
                                   config.short_seq_prob, config.seed, 2 if config.binary_head else 1),),
            allow_build)

    def __len__(self) -> int:
        return len(self.sample_index)

    def _pair(self, idx: int, rng: np.random.RandomState):
        """(A, B, is_random, truncated, target length) of sample ``idx``."""
        beg, end, target = (int(v) for v in self.sample_index[idx])
        sentences = [self.dataset[i].tolist() for i in range(beg, end)]
        pivot, swapped = len(sentences), False
        if self.config.binary_head:
            if len(sentences) < 2:
                raise DataError(f"BERT sample {idx} has one sentence: the binary head needs two")
            pivot = rng.randint(low=1, high=len(sentences)) if len(sentences) >= 3 else 1
            swapped = rng.random() < 0.5
        a = [t for s in sentences[:pivot] for t in s]
        b = [t for s in sentences[pivot:] for t in s]
        if swapped:
            a, b = b, a
        truncated = len(a) + len(b) > target
        while len(a) + len(b) > target:
            longer = a if len(a) > len(b) else b
            del longer[0 if rng.random() < 0.5 else -1]
        return a, b, swapped, truncated, target

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        idx = int(idx)
        rng = np.random.RandomState(seed=(self.config.seed + idx) % 2 ** 32)
        a, b, swapped, truncated, target = self._pair(idx, rng)
        tok = self.tokenizer
        tokens = [tok.cls, *a, tok.sep] + ([*b, tok.sep] if b else [])
        types = [0] * (len(a) + 2) + ([1] * (len(b) + 1) if b else [])
        cands = candidates_of(tokens, self.specials, tok.continues, self.masking.whole_word)
        tokens, positions, labels, _ = mask_tokens(tokens, target, self.masking, cands, self.replace, rng)
        s = self.config.seq_length
        pads = s - len(tokens)
        text = np.array(tokens + [self.pad] * pads, dtype=np.int64)
        types = np.array(types + [self.pad] * pads, dtype=np.int64)
        padding = np.ones(s, dtype=np.int64)
        padding[text == self.pad] = self.pad
        label = np.full(s, -1, dtype=np.int64)
        label[positions] = labels
        loss_mask = np.zeros(s, dtype=np.int64)
        loss_mask[positions] = 1
        text[text == self.pad] = 0
        label[label == self.pad] = 0
        return {"text": torch.from_numpy(text), "types": torch.from_numpy(types), "labels": torch.from_numpy(label),
                "is_random": torch.tensor(int(swapped)), "padding_mask": torch.from_numpy(padding),
                "loss_mask": torch.from_numpy(loss_mask), "truncated": torch.tensor(int(truncated))}


def bert_builder(config: BertDataConfig, tokenizer):
    """``make_builder`` of ``build_train_valid_test_datasets`` for BERT: splits over documents, as Megatron's
    masked datasets (their unit is the document, not the sentence)."""
    def make(indexed, prefix, documents, size, split_name, allow_build):
        return BertDataset(indexed, prefix, documents, size, split_name, config, tokenizer, allow_build)
    return document_builder(make, config, tokenizer)


def document_builder(make, config, tokenizer):
    """A ``make_builder`` whose datasets split over documents (BERT's, T5's): ``make(indexed, prefix, documents,
    size, split name, allow_build)`` builds one split of one indexed dataset."""
    from paratron.data.blended import EmptySplit, _Builder
    from paratron.data.indices import SPLIT_NAMES, split_range

    class DocumentBuilder(_Builder):
        def single(self, prefix: str, bounds, size: Optional[int], split: int):
            data = self.indexed(prefix)
            beg, end = split_range(bounds, data.num_documents)
            if beg >= end:
                raise (EmptySplit if split else DataError)(
                    f"{prefix}: the {SPLIT_NAMES[split]} split ({bounds[0]:.4f}-{bounds[1]:.4f} of "
                    f"{data.num_documents} documents, --split {config.split}) has no documents; add data or "
                    "change --split")
            return make(data, prefix, np.arange(beg, end, dtype=np.int64), size, SPLIT_NAMES[split], self.allow_build)

    return lambda allow_build: DocumentBuilder(config, allow_build, tokenizer.vocab_size)

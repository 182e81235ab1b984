"""What Megatron's masked-LM datasets (T5's span corruption; BERT's masking) share, in Megatron's order so that the
same seed gives the same samples as megatron-core:

* :func:`build_sample_mapping`: samples as runs of whole sentences of one document, (first sentence, end
  sentence, target length) per sample, the target length drawn short with ``--short-seq-prob`` (Megatron's
  ``helpers.build_mapping``: a 32-bit Mersenne Twister for the lengths, a 64-bit one for the final shuffle);
* :func:`masked_spans`: the N-gram candidates (whole words with WordPiece's ``##`` continuations) shuffled,
  then masked until the budget ``mask_prob`` x length is spent (Megatron's ``_create_masked_lm_predictions``
  without permutation), with N drawn from a geometric distribution (SpanBERT's, T5's) or 1/N weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from .errors import DataError

LONG_SENTENCE = 512  # documents with a longer sentence are left out (Megatron's LONG_SENTENCE_LEN)
_MASK64 = (1 << 64) - 1


def mt19937_raw(seed: int):
    """C++'s ``std::mt19937(seed)`` outputs, one by one (numpy's legacy seeding is the same init_genrand)."""
    gen = np.random.MT19937()
    gen.state = np.random.RandomState(seed).get_state(legacy=False)
    while True:
        yield from (int(x) for x in gen.random_raw(1024))


class MT19937_64:
    """C++'s ``std::mt19937_64(seed)`` (the 64-bit Mersenne Twister; numpy has only the 32-bit one)."""

    N, M = 312, 156

    def __init__(self, seed: int):
        mt = [seed & _MASK64]
        for i in range(1, self.N):
            prev = mt[-1]
            mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
        self.mt, self.index = mt, self.N

    def _twist(self) -> None:
        mt, n, m = self.mt, self.N, self.M
        for i in range(n):
            x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % n] & 0x7FFFFFFF)
            mt[i] = mt[(i + m) % n] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
        self.index = 0

    def __call__(self) -> int:
        if self.index >= self.N:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        return y ^ (y >> 43)


def _target_length(ratio: int, max_length: int, draw) -> int:
    if ratio == 0:
        return max_length
    r = next(draw)
    return 2 + r % (max_length - 1) if r % ratio == 0 else max_length


def build_sample_mapping(docs: np.ndarray, sizes: np.ndarray, num_epochs: int, max_samples: int, max_length: int,
                         short_seq_prob: float, seed: int, min_sentences: int) -> np.ndarray:
    """[n, 3] int64 rows (first sentence, end sentence, target length), shuffled. ``docs``: the sentence index
    where each document starts, then the end of the last; epochs repeat until ``max_samples`` are reached (the
    epoch that reaches it is completed, as Megatron's)."""
    ratio = int(math.floor(1.0 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
    draw, rows = mt19937_raw(seed), []
    for epoch in range(num_epochs):
        if len(rows) >= max_samples:
            break
        before = len(rows)
        for doc in range(len(docs) - 1):
            first, last = int(docs[doc]), int(docs[doc + 1])
            remain = last - first
            if remain < min_sentences or (remain > 1 and int(sizes[first:last].max()) > LONG_SENTENCE):
                continue
            length, count, start = 0, 0, first
            target = _target_length(ratio, max_length, draw)
            for sent in range(first, last):
                length, count, remain = length + int(sizes[sent]), count + 1, remain - 1
                if (length >= target and remain > 1 and count >= min_sentences) or remain == 0:
                    rows.append((start, sent + 1, target))
                    start, length, count = sent + 1, 0, 0
                    target = _target_length(ratio, max_length, draw)
        if len(rows) == before:
            raise DataError(f"no sample can be made from these documents (each needs {min_sentences} sentence(s) "
                            f"of at most {LONG_SENTENCE} tokens)")
    out = np.array(rows, dtype=np.int64).reshape(-1, 3)
    shuffle = MT19937_64(seed + 1)
    for i in range(len(out) - 1, 0, -1):
        j = shuffle() % (i + 1)
        out[[i, j]] = out[[j, i]]
    return out


@dataclass(frozen=True)
class Masking:
    """Megatron's masking knobs (MaskedWordPieceDatasetConfig): T5 uses max N 10, whole words, geometric N."""
    mask_prob: float = 0.15
    max_ngram: int = 10
    full_word: bool = True
    geometric: bool = True
    longer_ngrams: bool = False


def word_candidates(tokens: Sequence[int], boundary: Callable[[int], bool],
                    continuation: Callable[[int], bool], full_word: bool) -> list[list[int]]:
    """Positions grouped into maskable words: ``boundary`` tokens ([CLS], [SEP]) never masked; a ``continuation``
    piece joins the word before it when ``full_word``."""
    out: list[list[int]] = []
    for i, tok in enumerate(tokens):
        if boundary(tok):
            continue
        if continuation(tok) and full_word and out:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _ngram_length(m: Masking, probs: np.ndarray, available: int, rng: np.random.RandomState) -> int:
    if m.geometric:
        return min(int(rng.geometric(0.2)), m.max_ngram)
    p = probs[:available] / probs[:available].sum(keepdims=True)
    return int(rng.choice(np.arange(1, m.max_ngram + 1)[:available], p=p))


def masked_spans(tokens: Sequence[int], target_length: int, words: list[list[int]], m: Masking,
                 rng: np.random.RandomState, mask_token: Optional[Callable[[], Optional[int]]] = None):
    """(masked ids, spans): the spans [(positions, original ids)] in position order; ``mask_token()`` gives each
    masked position's new id (None: kept), as Megatron draws it position by position."""
    budget = min(m.mask_prob * target_length, max(1, int(round(len(tokens) * m.mask_prob))))
    probs = 1.0 / np.arange(1, m.max_ngram + 1)
    probs = (probs / probs.sum(keepdims=True))[::-1] if m.longer_ngrams else probs / probs.sum(keepdims=True)
    ngrams = [[words[i:i + n] for n in range(1, m.max_ngram + 1)] for i in range(len(words))]
    rng.shuffle(ngrams)
    out, spans, taken, count = list(tokens), [], set(), 0
    for grams in ngrams:
        if count >= budget:
            break
        n = _ngram_length(m, probs, len(grams), rng)
        while True:  # the longest n-gram from here that still fits the budget
            positions = sum(grams[n - 1], [])
            n -= 1
            if budget >= count + len(positions) or n == 0:
                break
        if budget < count + len(positions) or any(p in taken for p in positions):
            continue
        for p in positions:
            taken.add(p)
            new = mask_token() if mask_token is not None else None
            out[p] = tokens[p] if new is None else new
        count += len(positions)
        spans.append((positions, [tokens[p] for p in positions]))
    rng.shuffle(ngrams)  # Megatron draws this shuffle after masking (for its permutation pass)
    return out, sorted(spans, key=lambda s: s[0][0])

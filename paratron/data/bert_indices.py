"""The sample index of Megatron's BERT dataset (megatron-core's ``helpers.build_mapping``), in numpy.

A sample is a run of consecutive sentences of one document: ``(first sentence, end sentence, target length)``.
For each epoch and each document of the split with at least ``min_sentences`` sentences and none longer than
512 tokens, sentences are taken until the run reaches its target length (and at least two sentences remain
and it has ``min_sentences``), or the document ends. The target is ``max_length`` except, with
``--short-seq-prob p``, when a draw ``r`` of a 32-bit Mersenne Twister (MT19937 seeded with ``seed``)
has ``r % round(1/p) == 0``: then ``2 + r % (max_length - 1)``. Epochs repeat until the samples reach the
number asked for (whole epochs). The samples are then shuffled by a Fisher-Yates pass driven by a 64-bit
Mersenne Twister (MT19937-64 seeded with ``seed + 1``): for i from n-1 down to 1, swap i with ``draw % (i+1)``.
The result is [n, 3], uint32 (uint64 past 2^32 sentences), the arrays megatron-core builds for the same inputs.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from paratron.data.errors import DataError

LONG_SENTENCE_LEN = 512  # a document with a longer sentence gives no sample (Megatron's constant)
_M64 = (1 << 64) - 1


class MT32:
    """Raw 32-bit outputs of MT19937 seeded as C++'s ``std::mt19937(seed)`` (numpy's legacy seeding is the same
    ``init_genrand``), drawn in blocks."""

    def __init__(self, seed: int, block: int = 4096):
        self._gen = np.random.MT19937()
        self._gen.state = np.random.RandomState(seed & 0xFFFFFFFF).get_state(legacy=False)
        self._block, self._buf, self._at = block, np.empty(0, dtype=np.uint64), 0

    def __call__(self) -> int:
        if self._at == len(self._buf):
            self._buf, self._at = self._gen.random_raw(self._block), 0
        self._at += 1
        return int(self._buf[self._at - 1])


class MT64:
    """MT19937-64 (Matsumoto & Nishimura's 64-bit Mersenne Twister), as C++'s ``std::mt19937_64(seed)``; the
    state is regenerated with numpy in three vectorised parts."""

    N, M = 312, 156
    A = np.uint64(0xB5026F5AA96619E9)
    UPPER, LOWER = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)

    def __init__(self, seed: int):
        mt = [seed & _M64]
        for i in range(1, self.N):
            mt.append((6364136223846793005 * (mt[-1] ^ (mt[-1] >> 62)) + i) & _M64)
        self.mt, self.out, self.at = np.array(mt, dtype=np.uint64), None, self.N

    def _mix(self, hi: np.ndarray, lo: np.ndarray, far: np.ndarray) -> np.ndarray:
        x = (hi & self.UPPER) | (lo & self.LOWER)
        return far ^ (x >> np.uint64(1)) ^ ((x & np.uint64(1)) * self.A)

    def _twist(self) -> None:
        mt, n, m = self.mt, self.N, self.M
        mt[:n - m] = self._mix(mt[:n - m], mt[1:n - m + 1], mt[m:])
        mt[n - m:n - 1] = self._mix(mt[n - m:n - 1], mt[n - m + 1:], mt[:m - 1])
        mt[n - 1:] = self._mix(mt[n - 1:], mt[:1], mt[m - 1:m])
        y = mt.copy()
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        self.out, self.at = [int(v) for v in y], 0

    def __call__(self) -> int:
        if self.at == self.N:
            self._twist()
        self.at += 1
        return self.out[self.at - 1]


def _target_length(ratio: int, max_length: int, draw: MT32) -> int:
    if ratio == 0:
        return max_length
    r = draw()
    return 2 + r % (max_length - 1) if r % ratio == 0 else max_length


def _epoch(docs, sizes, max_length: int, ratio: int, min_sentences: int, draw: MT32, out: list) -> None:
    """Append one epoch's samples (first sentence, end sentence, target length) to ``out``."""
    for d in range(len(docs) - 1):
        first, last = int(docs[d]), int(docs[d + 1])
        remain = last - first
        if remain < min_sentences or (remain > 1 and int(sizes[first:last].max()) > LONG_SENTENCE_LEN):
            continue
        start, seq_len, count = first, 0, 0
        target = _target_length(ratio, max_length, draw)
        for sent in range(first, last):
            seq_len += int(sizes[sent])
            count += 1
            remain -= 1
            if (seq_len >= target and remain > 1 and count >= min_sentences) or remain == 0:
                out.append((start, sent + 1, target))
                start, seq_len, count = sent + 1, 0, 0
                target = _target_length(ratio, max_length, draw)


def build_mapping(docs: np.ndarray, sizes: np.ndarray, num_samples: Optional[int], max_length: int,
                  short_seq_prob: float, seed: int, min_sentences: int) -> np.ndarray:
    """[n, 3] samples of the documents whose sentence boundaries are ``docs`` (``document_indices`` of the
    split's documents and the next one), sentence lengths ``sizes``; ``num_samples`` None: one epoch."""
    if max_length <= 1:
        raise DataError(f"BERT samples of {max_length + 3} tokens leave no room for sentences: raise --seq-length")
    ratio = int(math.floor(1.0 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
    draw, samples = MT32(seed), []
    while num_samples is None or len(samples) < num_samples:
        before = len(samples)
        _epoch(docs, sizes, max_length, ratio, min_sentences, draw, samples)
        if len(samples) == before:
            raise DataError(f"no BERT sample can be made: every document has fewer than {min_sentences} "
                            f"sentence(s) or a sentence over {LONG_SENTENCE_LEN} tokens (preprocess with "
                            "--split-sentences; --bert-no-binary-head needs only one sentence)")
        if num_samples is None:
            break
    dtype = np.uint64 if len(sizes) > np.iinfo(np.uint32).max else np.uint32
    maps = np.array(samples, dtype=dtype).reshape(-1, 3)
    shuffle = MT64(seed + 1)
    for i in range(len(maps) - 1, 0, -1):
        j = shuffle() % (i + 1)
        if j != i:
            maps[[i, j]] = maps[[j, i]]
    return maps

"""The index arithmetic behind GPT sample order, as pure numpy functions.

These reproduce Megatron's GPTDataset and BlendedDataset indices exactly (same seed, same inputs ->
same arrays, same dtypes), so sample i of a paratron dataset holds the tokens Megatron would give:

- split string -> per-split [lo, hi) fractions -> a document range per split;
- document index: the split's documents tiled once per epoch (int32), shuffled by one
  `numpy.random.RandomState(seed)`, the last epoch shuffled on its own when it supplies under 80 %
  of an epoch's samples;
- sample index [num_samples + 1, 2]: (position in the document index, token offset) where each
  sample starts; sample j spans seq_length + 1 tokens and the next one starts on its last token;
- shuffle index: a permutation of the samples drawn from the same RandomState;
- blending: sample i of a blend goes to argmax_d(w_d * max(i, 1) - taken_d), ties to the lowest d.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from paratron.config.check_data import split_numbers
from paratron.data.errors import DataError
from paratron.errors import ConfigError

SPLIT_NAMES = ("train", "valid", "test")
# When the last epoch supplies fewer samples than this fraction of an epoch, shuffle it apart.
SEPARATE_LAST_EPOCH_BELOW = 0.80
# A blend asks each member for this much more than its share, so the greedy blend never runs dry.
BLEND_SURPLUS = 0.005


def parse_split(split: str) -> List[float]:
    """'969,30,1' -> normalised [train, valid, test] fractions (missing entries are 0)."""
    try:
        numbers = split_numbers(split)
    except ConfigError as e:
        raise DataError(str(e)) from None
    numbers += [0.0] * (3 - len(numbers))
    total = float(np.sum(np.array(numbers, dtype=np.float64)))
    return (np.array(numbers, dtype=np.float64) / total).tolist()


def split_bounds(fractions: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Cumulative [lo, hi) bounds of each split; None for a split of zero width."""
    edges = [0.0]
    for frac in fractions:
        edges.append(edges[-1] + frac)
    bounds: List[Optional[Tuple[float, float]]] = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        bounds.append((lo, hi) if hi > lo else None)
    return bounds


def split_range(bounds: Tuple[float, float], num_elements: int) -> Tuple[int, int]:
    """The [begin, end) element range that a split's bounds select out of `num_elements`."""
    lo, hi = bounds
    return int(round(lo * float(num_elements))), int(round(hi * float(num_elements)))


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
    """Smallest e >= 1 with e * tokens_per_epoch >= num_samples * seq_length + 1."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last: bool
) -> np.ndarray:
    """The documents tiled `num_epochs` times (int32), shuffled in place by `rng`."""
    if separate_last and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    index = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
    rng.shuffle(index)
    return index


def build_sample_index(
    sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
    tokens_per_epoch: int,
) -> np.ndarray:
    """[num_samples + 1, 2] array of (document-index position, offset) where each sample starts.

    Sample j covers flat token positions [j*s, j*s + s] of the documents laid end to end in
    document-index order; row j is the document holding position j*s (the first document whose
    end lies beyond it, so empty documents are stepped over) and the offset inside it.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    largest = max(len(document_index), int(sizes.max()) if len(sizes) else 0)
    dtype = np.int32 if largest <= np.iinfo(np.int32).max else np.int64
    doc_ends = np.cumsum(sizes[document_index], dtype=np.int64)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    where = np.searchsorted(doc_ends, starts, side="right")
    doc_begins = np.concatenate(([0], doc_ends[:-1]))
    where_safe = np.minimum(where, len(doc_ends) - 1)
    offsets = starts - doc_begins[where_safe]
    index = np.empty((num_samples + 1, 2), dtype=dtype)
    index[:, 0] = where
    index[:, 1] = offsets
    index[0] = (0, 0)  # the first sample starts at the very beginning, even on an empty document
    return index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """arange(total_size) with [0, num_samples) and [num_samples, total_size) shuffled apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: Optional[int], seed: int
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle index of one GPT dataset split.

    `sizes` are all sequence lengths of the underlying dataset, `documents` the split's sequence
    ids, `num_samples` the samples wanted (None: one epoch)."""
    if seq_length < 2:
        raise DataError(f"--seq-length {seq_length}: must be at least 2")
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch < 2:
        raise DataError(f"a split of {len(documents)} documents has {tokens_per_epoch} tokens")
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_last = False
    before_last = 0
    if epochs > 1:
        before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_last = num_samples - before_last
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last = from_last < int(SEPARATE_LAST_EPOCH_BELOW * per_epoch)
    rng = np.random.RandomState(seed)
    doc_index = build_document_index(documents, epochs, rng, separate_last)
    sample_index = build_sample_index(sizes, doc_index, seq_length, epochs, tokens_per_epoch)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before_last if separate_last else total, total, rng)
    return doc_index, sample_index, shuffle_index


def blend_sizes(weights: Sequence[float], target: int, surplus: float = 0.0) -> List[int]:
    """Samples to ask of each member of a blend: ceil(ceil(target * w) * (1 + surplus))."""
    return [int(math.ceil(math.ceil(target * w) * (1 + surplus))) for w in weights]


def normalize(weights: Sequence[float]) -> List[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """For each of `size` samples: which dataset (int16) and which of its samples (int64).

    Greedy: sample i goes to the dataset whose share lags most, argmax_d(w_d*max(i,1) - taken_d),
    ties to the lowest d (the same float arithmetic as Megatron's helper, so identical output)."""
    weights = [float(w) for w in weights]
    k = len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    taken = [0] * k
    choice = [0] * size
    position = [0] * size
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best, best_err = 0, weights[0] * x - taken[0]
        for d in range(1, k):
            err = weights[d] * x - taken[d]
            if err > best_err:
                best, best_err = d, err
        choice[i] = best
        position[i] = taken[best]
        taken[best] += 1
    if size:
        dataset_index[:] = choice
        sample_index[:] = position
    return dataset_index, sample_index

"""Masked-LM predictions of Megatron's masked WordPiece datasets (BERT, and T5's span corruption), with the
draws of Megatron's, so the same ``numpy.random.RandomState`` gives the same masks.

* Candidates: each token but [CLS] / [SEP] starts a candidate unless it continues a word (a WordPiece
  ``##`` piece), which joins the candidate before it when ``whole_word`` (whole-word masking).
* Budget: ``min(p * target_length, max(1, round(len(tokens) * p)))`` tokens.
* The n-grams of candidates starting at each candidate (n = 1 .. ``max_ngram``) are shuffled; each in turn
  draws its length n with probability proportional to 1/n (``longer_ngrams``: reversed; ``geometric``:
  min(Geometric(0.2), max_ngram), SpanBERT's), shortened until it fits the budget, and is skipped when it
  overlaps one taken. Each token of a taken n-gram is replaced through ``replace(rng)`` (BERT: 80 % [MASK],
  10 % a random id, 10 % itself).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class MaskingConfig:
    probability: float = 0.15  # --mask-prob
    max_ngram: int = 3
    whole_word: bool = True
    longer_ngrams: bool = False
    geometric: bool = False


def candidates_of(tokens: Sequence[int], specials: Sequence[int], continues: Callable[[int], bool],
                  whole_word: bool) -> List[List[int]]:
    """The positions that may be masked, grouped into whole words when ``whole_word``."""
    out: List[List[int]] = []
    for i, t in enumerate(tokens):
        if t in specials:
            continue
        if continues(t) and whole_word and out:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _ngram_length(cfg: MaskingConfig, probs: np.ndarray, lengths: np.ndarray, available: int,
                  rng: np.random.RandomState) -> int:
    if cfg.geometric:
        return int(min(rng.geometric(0.2), cfg.max_ngram))
    p = probs[:available] / probs[:available].sum(keepdims=True)
    return int(rng.choice(lengths[:available], p=p))


def mask_tokens(tokens: Sequence[int], target_length: int, cfg: MaskingConfig, candidates: List[List[int]],
                replace: Callable[[np.random.RandomState], Optional[int]], rng: np.random.RandomState
                ) -> Tuple[List[int], List[int], List[int], List[Tuple[List[int], List[int]]]]:
    """(masked tokens, masked positions, their labels, masked spans (positions, labels)), positions sorted."""
    budget = min(cfg.probability * target_length, max(1, int(round(len(tokens) * cfg.probability))))
    lengths = np.arange(cfg.max_ngram, dtype=np.int64) + 1
    probs = 1.0 / lengths
    probs = probs / probs.sum(keepdims=True)
    if cfg.longer_ngrams:
        probs = probs[::-1]
    ngrams = [[candidates[i:i + n] for n in lengths] for i in range(len(candidates))]
    rng.shuffle(ngrams)
    out, taken, spans, used = list(tokens), [], [], set()
    for grams in ngrams:
        if len(taken) >= budget:
            break
        n = _ngram_length(cfg, probs, lengths, len(grams), rng)
        while True:  # shorten until it fits the budget (or give the candidate up)
            positions = sum(grams[n - 1], [])
            n -= 1
            if budget >= len(taken) + len(positions):
                break
            if n == 0:
                positions = None
                break
        if positions is None or any(i in used for i in positions):
            continue
        for i in positions:
            used.add(i)
            new = replace(rng)
            out[i] = tokens[i] if new is None else new
            taken.append((i, tokens[i]))
        spans.append((positions, [tokens[i] for i in positions]))
    taken.sort(key=lambda x: x[0])
    spans.sort(key=lambda x: x[0][0])
    return out, [i for i, _ in taken], [t for _, t in taken], spans


def bert_replacement(mask_id: int, vocab_ids: Sequence[int]) -> Callable[[np.random.RandomState], Optional[int]]:
    """BERT's 80/10/10: [MASK] with probability 0.8, else half the time a random id of ``vocab_ids``, else
    None (the token stays)."""
    def replace(rng: np.random.RandomState) -> Optional[int]:
        if rng.random() < 0.8:
            return mask_id
        if rng.random() >= 0.5:
            return vocab_ids[rng.randint(0, len(vocab_ids))]
        return None
    return replace

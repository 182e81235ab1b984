"""Fill-in-the-middle samples (Megatron's ``--fim-data``), for code models that learn to complete the
middle of a file from what comes before and after it.

Each sample of seq_length + 1 tokens is cut at the ``--fim-eod-token`` into documents. A document is
rewritten with probability ``--fim-rate``: its text (special tokens left out) is cut at two character
positions drawn uniformly into prefix, middle and suffix, each re-tokenized, and laid out as

    PSM:  <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM:  <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle     (probability --fim-spm-rate)

so the model, trained left to right, predicts the middle after seeing both sides. With
``--fim-split-sample TOKEN`` a document holding that token (say, a file separator in a repository) is
rewritten, with probability ``--fim-rate``, fragment by fragment, each with ``--fim-fragment-rate``.
``--fim-no-prefix TEXT`` leaves documents (fragments) that start with TEXT as they are. The rewritten
sample is cut back to its length or padded with ``--fim-pad-token``, whose positions carry no loss.

Where paratron differs from Megatron's GPTFIMDataset, on purpose: each sample draws from its own
generator, seeded by (--seed, split, sample index), so a sample is rewritten the same way whatever
the number of DataLoader workers or the step a run resumes at (Megatron's one generator per dataset
depends on the order samples are read); separator tokens (EOD, the split token) are always kept, also
around empty documents (Megatron drops them there); an empty trailing document gets no sentinels; and
the FIM pad positions are masked out of the loss.
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Optional

import numpy as np
import torch

from .errors import DataError
from .gpt_dataset import GPTDataset

ROLES = ("prefix", "middle", "suffix", "pad", "eod")


class FIMTransform:
    """The rewrite of one sample's tokens; built from the data section and the tokenizer."""

    def __init__(self, data, tokenizer, seed: int):
        self.tokenizer, self.seed = tokenizer, int(seed)
        self.rate, self.spm_rate = float(data.fim_rate), float(data.fim_spm_rate)
        self.fragment_rate = data.fim_fragment_rate
        self.no_prefix = data.fim_no_prefix
        names = {role: getattr(data, f"fim_{role}_token") for role in ROLES}
        ids: Dict[str, Optional[int]] = {role: tokenizer.token_id(name) for role, name in names.items()}
        missing = [f"{names[r]} (--fim-{r}-token)" for r in ROLES if ids[r] is None]
        if missing:
            raise DataError(f"--fim-data: the tokenizer ({type(tokenizer).__name__}) has no single token for "
                            f"{', '.join(missing)}; use a tokenizer that has FIM tokens (e.g. a HuggingFace "
                            "tokenizer.json of a code model) or name its tokens with those flags")
        self.ids = ids
        self.split = None
        if data.fim_split_sample is not None:
            self.split = tokenizer.token_id(data.fim_split_sample)
            if self.split is None:
                raise DataError(f"--fim-split-sample {data.fim_split_sample!r} is not one token of the tokenizer's "
                                "vocabulary; give a token it has (e.g. a file separator)")

    def __call__(self, sample: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``sample`` rewritten, cut back or padded to its length."""
        eod, n = self.ids["eod"], len(sample)
        pieces: List[np.ndarray] = []
        for k, doc in enumerate(_split(sample, eod)):
            if k:
                pieces.append(np.array([eod], dtype=np.int64))
            if len(doc):
                pieces.append(self._document(doc, rng))
        out = np.concatenate(pieces) if pieces else sample[:0]
        if len(out) >= n:
            return out[:n]
        return np.concatenate([out, np.full(n - len(out), self.ids["pad"], dtype=np.int64)])

    def _document(self, doc: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.split is None or not (doc == self.split).any():
            return self._rewrite(doc, self.rate, rng)
        if rng.random() >= self.rate:
            return doc
        pieces: List[np.ndarray] = []
        for k, fragment in enumerate(_split(doc, self.split)):
            if k:
                pieces.append(np.array([self.split], dtype=np.int64))
            if len(fragment):
                pieces.append(self._rewrite(fragment, self.fragment_rate, rng))
        return np.concatenate(pieces)

    def _rewrite(self, tokens: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
        """One document (fragment) in PSM or SPM order, with probability ``rate``."""
        if rng.random() >= rate:
            return tokens
        text = self.tokenizer.text_of(tokens.tolist())
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return tokens
        a, b = sorted(int(x) for x in rng.integers(0, len(text) + 1, size=2))
        prefix, middle, suffix = (self.tokenizer.ids_of(t) for t in (text[:a], text[a:b], text[b:]))
        pre, mid, suf = self.ids["prefix"], self.ids["middle"], self.ids["suffix"]
        if rng.random() < self.spm_rate:
            order = [pre, suf, *suffix, mid, *prefix, *middle]
        else:
            order = [pre, *prefix, suf, *suffix, mid, *middle]
        return np.array(order, dtype=np.int64)


def _split(tokens: np.ndarray, separator: int) -> List[np.ndarray]:
    """``tokens`` cut at every ``separator`` (left out): k separators give k + 1 parts, some maybe empty."""
    cuts = np.flatnonzero(tokens == separator)
    starts, ends = np.concatenate([[0], cuts + 1]), np.concatenate([cuts, [len(tokens)]])
    return [tokens[s:e] for s, e in zip(starts, ends)]


class GPTFIMDataset(GPTDataset):
    """A GPTDataset (same indices and cache) whose samples are rewritten by a :class:`FIMTransform`."""

    def __init__(self, *args, fim: FIMTransform, **kwargs):
        super().__init__(*args, **kwargs)
        self.fim = fim
        self._stream = zlib.crc32(self.split_name.encode())  # train / valid / test draw apart

    def text(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng([self.fim.seed, self._stream, int(idx)])
        return self.fim(super().text(idx), rng)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        sample = super().__getitem__(idx)
        sample["loss_mask"][sample["labels"] == self.fim.ids["pad"]] = 0.0
        return sample

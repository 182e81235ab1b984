"""GPTDataset: fixed-length training samples cut from an indexed dataset, in Megatron's order.

A dataset is one split (train/valid/test) of one `.bin/.idx` prefix. Its three indices (see
`paratron.data.indices`) are built once and cached as `.npy` files:

    {cache}/{md5}-GPTDataset-{split}-{document_index|sample_index|shuffle_index}.npy

where md5 hashes a JSON description of everything the indices depend on (written beside them as
`...-description.txt`). The cache defaults to `{prefix}/cache/GPTDataset_indices` as in Megatron;
`data_cache_path` moves it. Files are written whole and renamed, so a rank that loads them never
sees a partial file.

Sample i is a dict of tensors: `tokens`, `labels` (the same text shifted by one), `loss_mask`,
`position_ids`, and `document_ids` [s] only with `reset_attention_mask`: the document of each
token (an EOD closes its document), from which attention builds its document-causal pattern
(Megatron's dense [1, s, s] `attention_mask` would be 16 GB at s = 128k, and could not be split
over context-parallel ranks; `get_ltor_masks_and_position_ids` still gives it, as Megatron's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from paratron.data.errors import DataError
from paratron.errors import os_error_reason
from paratron.data.indices import build_gpt_indices

logger = logging.getLogger(__name__)
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


@dataclass
class GPTDataConfig:
    """What a GPTDataset needs besides its data: Megatron's names where it has one."""

    seq_length: int
    seed: int = 1234
    eod: Optional[int] = None
    pad: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    data_cache_path: Optional[str] = None
    split: Optional[str] = None
    mmap_bin_files: bool = True  # False: --no-mmap-bin-files
    tokenizer_id: Dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_config(cls, data, tokenizer, seq_length: int, seed: int = 1234) -> "GPTDataConfig":
        """From the config's data section (a `paratron.config.DataConfig`) and the tokenizer."""
        pad = getattr(tokenizer, "pad", None)
        eod = tokenizer.eod
        if not isinstance(pad, (int, np.integer)) or pad < 0 or pad == eod:
            pad = None  # no pad id, or one that collides with EOD: mask nothing as padding
        return cls(
            seq_length=int(seq_length),
            seed=int(seed),
            eod=eod,
            pad=pad,
            reset_position_ids=bool(data.reset_position_ids),
            reset_attention_mask=bool(data.reset_attention_mask),
            eod_mask_loss=bool(data.eod_mask_loss),
            data_cache_path=data.data_cache_path,
            split=data.split,
            mmap_bin_files=not getattr(data, "no_mmap_bin_files", False),
            tokenizer_id=dict(getattr(tokenizer, "unique_identifiers", {"class": "?"})),
        )


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor, eod: Optional[int], reset_position_ids: bool,
    reset_attention_mask: bool, eod_mask_loss: bool,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Masks and positions of one left-to-right sample (1-D `tokens`).

    attention_mask [1, s, s] bool, True where attention is NOT allowed; built only with
    reset_attention_mask (then no token sees across an EOD). position_ids restart after each EOD
    with reset_position_ids. loss_mask is 0 on EOD tokens with eod_mask_loss."""
    s = tokens.numel()
    is_eod = tokens == eod if eod is not None else torch.zeros(s, dtype=torch.bool)
    loss_mask = torch.ones(s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = torch.arange(s, dtype=torch.int64)
    # segment[j] = number of EODs strictly before j: an EOD closes its document.
    segment = torch.cumsum(is_eod.to(torch.int64), 0) - is_eod.to(torch.int64)
    if reset_position_ids:
        eod_at = positions[is_eod]
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), eod_at + 1])
        positions = positions - starts[segment]
    attention_mask = None
    if reset_attention_mask:
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        same_doc = segment.unsqueeze(1) == segment.unsqueeze(0)
        attention_mask = (~(causal & same_doc)).unsqueeze(0)
    return attention_mask, loss_mask, positions


def document_ids(tokens: torch.Tensor, eod: Optional[int]) -> torch.Tensor:
    """[s] int64: the number of EOD tokens strictly before each token of 1-D ``tokens`` (an EOD
    belongs to the document it closes); ``attention_mask`` above is ~(causal & same document id)."""
    is_eod = (tokens == eod if eod is not None else torch.zeros_like(tokens, dtype=torch.bool)).to(torch.int64)
    return torch.cumsum(is_eod, 0) - is_eod


def save_array(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def cache_paths(cache_dir: str, description: str, kind: str, split: str, names: Sequence[str]):
    digest = hashlib.md5(description.encode("utf-8")).hexdigest()
    base = os.path.join(cache_dir, f"{digest}-{kind}-{split}-")
    return base + "description.txt", {name: base + name + ".npy" for name in names}


def load_cached(paths: dict, names: Sequence[str]):
    """(the cached arrays, None), or (None, (file, reason)) for the first that cannot be read whole (a
    truncated or overwritten .npy: a save killed by something else than our atomic rename, a full disk)."""
    arrays = []
    for name in names:
        try:
            array = np.load(paths[name], mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            return None, (paths[name], str(err))
        if array.dtype.hasobject or array.ndim not in (1, 2):
            return None, (paths[name], f"an array of {array.ndim} dimensions, {array.dtype}: not an index")
        arrays.append(array)
    return tuple(arrays), None


def cached_build(cache_dir, description, kind, split, names, build, allow_build=True):
    """Load index arrays from the cache when all are there; else build them (and save them when
    allowed). Building is deterministic, so a rank that finds no cache may build too. A damaged cache
    file is rebuilt with a warning naming it; when it cannot be rewritten, a DataError names it."""
    if not cache_dir:
        return build()
    desc_path, paths = cache_paths(cache_dir, description, kind, split, names)
    damaged = None
    if all(os.path.isfile(p) for p in [desc_path, *paths.values()]):
        logger.info("loading %s %s indices from %s", kind, split, cache_dir)
        arrays, damaged = load_cached(paths, names)
        if arrays is not None:
            return arrays
        logger.warning("WARNING: damaged %s index cache file %s (%s); rebuilding the %s indices", kind, *damaged, split)
    arrays = build()
    if allow_build:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for name, array in zip(names, arrays):
                save_array(paths[name], array)
            with open(desc_path + f".tmp-{os.getpid()}", "w") as f:
                f.write(description)
            os.replace(desc_path + f".tmp-{os.getpid()}", desc_path)
        except OSError as err:
            if damaged:
                raise DataError(f"the index cache file {damaged[0]} is damaged ({damaged[1]}) and cannot be "
                                f"rebuilt in {cache_dir} ({os_error_reason(err)}); delete it or choose another "
                                "--data-cache-path") from None
            logger.warning("cannot cache %s indices in %s: %s", kind, cache_dir, err)
    return arrays


class GPTDataset(torch.utils.data.Dataset):
    """One split of one indexed dataset. `documents` are the split's sequence ids (an int32 range),
    `num_samples` the samples wanted (None: one epoch; more may be built, never fewer)."""

    kind = "GPTDataset"

    def __init__(
        self, indexed, path_prefix: Optional[str], documents: np.ndarray,
        num_samples: Optional[int], split_name: str, config: GPTDataConfig,
        allow_build: bool = True,
    ):
        self.dataset = indexed
        self.path_prefix = path_prefix
        self.documents = documents
        self.num_samples = num_samples
        self.split_name = split_name
        self.config = config
        self.description = json.dumps(
            {
                "class": self.kind, "dataset_path": path_prefix, "num_samples": num_samples,
                "index_split": split_name, "random_seed": config.seed,
                "sequence_length": config.seq_length, "split": config.split,
                "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [],
                "num_sequences": len(indexed.sequence_lengths), "tokenizer": config.tokenizer_id,
            },
            indent=4,
        )
        self.document_index, self.sample_index, self.shuffle_index = cached_build(
            self._cache_dir(), self.description, self.kind, split_name, INDEX_NAMES,
            lambda: build_gpt_indices(
                indexed.sequence_lengths, documents, config.seq_length, num_samples, config.seed
            ),
            allow_build,
        )

    def _cache_dir(self) -> Optional[str]:
        if self.config.data_cache_path:
            return self.config.data_cache_path
        if self.path_prefix is None:
            return None
        return os.path.join(self.path_prefix, "cache", f"{self.kind}_indices")

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def text(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample `idx` (int64)."""
        j = int(self.shuffle_index[idx])
        first, offset = (int(x) for x in self.sample_index[j])
        last, end = (int(x) for x in self.sample_index[j + 1])
        get, docs = self.dataset.get, self.document_index
        if first == last:
            parts = [get(int(docs[first]), offset, end - offset + 1)]
        else:
            parts = [get(int(docs[first]), offset)]
            parts += [get(int(docs[i])) for i in range(first + 1, last)]
            parts.append(get(int(docs[last]), 0, end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        text = torch.from_numpy(self.text(int(idx)))
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        cfg = self.config
        _, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, cfg.eod, cfg.reset_position_ids, False, cfg.eod_mask_loss
        )
        if cfg.pad is not None:  # Megatron masks (and zeroes) pad ids found in the data
            loss_mask[labels == cfg.pad] = 0.0
            tokens[tokens == cfg.pad] = 0
            labels[labels == cfg.pad] = 0
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                  "position_ids": position_ids}
        if cfg.reset_attention_mask:  # ids of the text as read (before pad ids are zeroed)
            sample["document_ids"] = document_ids(text[:-1], cfg.eod)
        return sample


class MockIndexedData:
    """Megatron's mock documents: 100000 of them, lengths drawn from numpy default_rng(0) in
    [1, 4096), document i = (1, 2, ..., len-1) mod vocab followed by EOD."""

    size = 100000
    max_sequence_length = 4096

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod = int(vocab_size), int(eod)
        rng = np.random.default_rng(seed=0)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        n = int(self.sequence_lengths[idx])
        doc = np.concatenate([(np.arange(n - 1, dtype=np.int64) + 1) % self.vocab_size,
                              [self.eod]])
        end = n if length is None else offset + length
        return doc[offset:end]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockIndexedData (built in memory, never cached)."""

    kind = "MockGPTDataset"

    def _cache_dir(self) -> Optional[str]:
        return None

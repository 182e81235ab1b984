"""Megatron Core's GPTDatasetConfig and its mock / real GPT datasets, over paratron's GPTDataset.

A sample is Megatron's dict: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` and, with
``create_attention_mask`` (Megatron's default), ``attention_mask`` [1, s, s] bool, True where attention is
not allowed (causal, and within documents with ``reset_attention_mask``). Mock data are Megatron's:
100000 documents ``1, 2, ..., n-1 (mod vocab), EOD`` with lengths from numpy's default_rng(0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...data import gpt_dataset as D
from ...data.errors import DataError

SPLITS = ("train", "valid", "test")


@dataclass
class GPTDatasetConfig:
    """Megatron's fields (BlendedMegatronDatasetConfig's and GPTDatasetConfig's) that change the samples;
    ``blend`` None (and ``blend_per_split`` None) means mock data, split "1,1,1" as Megatron's."""
    random_seed: int
    sequence_length: int
    blend: Optional[tuple] = None  # ([prefix, ...], [weight, ...] or None)
    blend_per_split: Optional[list] = None
    split: Optional[str] = None
    num_dataset_builder_threads: int = 1
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = False
    tokenizer: Any = None
    mid_level_dataset_surplus: float = 0.005
    reset_position_ids: Optional[bool] = None
    reset_attention_mask: Optional[bool] = None
    eod_mask_loss: Optional[bool] = None
    create_attention_mask: bool = True
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    object_storage_cache_path: Optional[str] = None

    def __post_init__(self):
        if self.blend_per_split is not None and any(self.blend_per_split):
            raise DataError("GPTDatasetConfig(blend_per_split=...) is not supported by paratron.core; use "
                            "paratron's --train-data-path / --valid-data-path / --test-data-path")
        if not self.add_extra_token_to_sequence:
            raise DataError("GPTDatasetConfig(add_extra_token_to_sequence=False) is not supported by paratron.core")
        if self.tokenizer is None:
            raise DataError("GPTDatasetConfig needs a tokenizer (its vocab_size and eod)")
        if self.blend is None:
            self.mock, self.split = True, "1,1,1"

    def paratron(self) -> D.GPTDataConfig:
        """paratron's GPTDataConfig of the same samples."""
        pad = getattr(self.tokenizer, "pad", None)
        eod = self.tokenizer.eod
        return D.GPTDataConfig(seq_length=self.sequence_length, seed=self.random_seed, eod=eod,
                               pad=pad if isinstance(pad, int) and 0 <= pad != eod else None,
                               reset_position_ids=bool(self.reset_position_ids),
                               reset_attention_mask=bool(self.reset_attention_mask),
                               eod_mask_loss=bool(self.eod_mask_loss), data_cache_path=self.path_to_cache,
                               split=self.split, mmap_bin_files=self.mmap_bin_files,
                               tokenizer_id=dict(getattr(self.tokenizer, "unique_identifiers", {"class": "?"})))


def megatron_sample(sample: dict, create_attention_mask: bool) -> dict:
    """A paratron sample in Megatron's form: ``document_ids`` become the dense ``attention_mask``."""
    docs = sample.pop("document_ids", None)
    if create_attention_mask:
        s = sample["tokens"].numel()
        allowed = torch.ones(s, s, dtype=torch.bool).tril()
        if docs is not None:
            allowed &= docs.unsqueeze(1) == docs.unsqueeze(0)
        sample["attention_mask"] = (~allowed).unsqueeze(0)
    return sample


def _split_name(index_split) -> str:
    """Megatron's Split enum (or its value / name) as paratron's split name."""
    value = getattr(index_split, "value", index_split)
    return SPLITS[value] if isinstance(value, int) else str(getattr(index_split, "name", value))


class GPTDataset(D.GPTDataset):
    """Megatron's constructor (low-level dataset, path, document indices, samples, split, config)."""

    def __init__(self, indexed_dataset, dataset_path: Optional[str], indices, num_samples: Optional[int],
                 index_split, config: GPTDatasetConfig):
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, _split_name(index_split),
                         config.paratron())
        self.megatron_config = config

    def __getitem__(self, idx: int) -> dict:
        return megatron_sample(super().__getitem__(idx), self.megatron_config.create_attention_mask)


class MockGPTDataset(GPTDataset):
    """GPTDataset over Megatron's mock documents (built in memory, never cached)."""

    kind = "MockGPTDataset"

    def _cache_dir(self) -> Optional[str]:
        return None

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> D.MockIndexedData:
        return D.MockIndexedData(config.tokenizer.vocab_size, config.tokenizer.eod)

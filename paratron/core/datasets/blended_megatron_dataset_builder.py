"""Megatron Core's ``BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()``: the
[train, valid, test] datasets (None where a size is None or the split is empty of weight). Mock data
(``config.mock``) split Megatron's 100000 mock documents by ``config.split``; real data (``config.blend``)
go through paratron's builder (paratron/data/blended.py: one prefix, or a weighted blend)."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from ...data.blended import _Builder
from ...data.indices import parse_split, split_bounds, split_range
from .gpt_dataset import SPLITS, GPTDataset, GPTDatasetConfig, MockGPTDataset, megatron_sample


class MegatronSamples(torch.utils.data.Dataset):
    """A paratron dataset (a blend) whose samples come in Megatron's form (``attention_mask``)."""

    def __init__(self, dataset, create_attention_mask: bool):
        self.dataset, self.create_attention_mask = dataset, create_attention_mask

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        return megatron_sample(self.dataset[idx], self.create_attention_mask)


class BlendedMegatronDatasetBuilder:
    def __init__(self, cls, sizes: list, is_built_on_rank: Callable[[], bool], config: GPTDatasetConfig):
        if cls not in (MockGPTDataset, GPTDataset):
            raise TypeError(f"BlendedMegatronDatasetBuilder({getattr(cls, '__name__', cls)}): paratron.core builds "
                            "MockGPTDataset and GPTDataset")
        self.cls, self.sizes, self.is_built_on_rank, self.config = cls, list(sizes), is_built_on_rank, config

    def build(self) -> list:
        bounds = split_bounds(parse_split(self.config.split))
        if self.config.mock or self.cls is MockGPTDataset:
            return [self._mock(i, b) for i, b in enumerate(bounds)]
        return [self._real(i, b) for i, b in enumerate(bounds)]

    def _mock(self, split: int, bounds) -> Optional[MockGPTDataset]:
        size = self.sizes[split] if split < len(self.sizes) else None
        if size is None or bounds is None:
            return None
        low = MockGPTDataset.build_low_level_dataset(None, self.config)
        beg, end = split_range(bounds, len(low))
        return MockGPTDataset(low, None, np.arange(beg, end, dtype=np.int32), size, split, self.config)

    def _real(self, split: int, bounds):
        size = self.sizes[split] if split < len(self.sizes) else None
        if size is None or bounds is None:
            return None
        prefixes, weights = self.config.blend
        builder = _Builder(self.config.paratron(), allow_build=bool(self.is_built_on_rank()),
                           vocab_size=self.config.tokenizer.vocab_size)
        dataset = builder.blend((list(prefixes), weights), bounds, size, split)
        return MegatronSamples(dataset, self.config.create_attention_mask)


__all__ = ["BlendedMegatronDatasetBuilder", "MegatronSamples", "SPLITS"]

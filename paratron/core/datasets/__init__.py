"""Megatron Core's ``datasets``: GPTDatasetConfig, MockGPTDataset, GPTDataset and
BlendedMegatronDatasetBuilder over paratron's GPT datasets (paratron/data/gpt_dataset.py, blended.py)."""
from .blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from .gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

__all__ = ["BlendedMegatronDatasetBuilder", "GPTDataset", "GPTDatasetConfig", "MockGPTDataset"]

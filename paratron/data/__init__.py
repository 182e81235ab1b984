"""Data pipeline: Megatron-compatible .bin/.idx files, tokenizers, preprocessing, GPT datasets,
resumable samplers.

Submodules are imported lazily so that `import paratron.data` stays cheap.
"""

from paratron.data.errors import DataError

__all__ = [
    "DataError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "build_data_iterator",
    "train_valid_test_num_samples",
    "tokenizer_vocab_size",
]

_LAZY = {
    "IndexedDataset": "paratron.data.indexed",
    "IndexedDatasetWriter": "paratron.data.indexed",
    "build_tokenizer": "paratron.data.tokenizers",
    "build_train_valid_test_datasets": "paratron.data.blended",
    "build_data_iterator": "paratron.data.loader",
    "train_valid_test_num_samples": "paratron.data.blended",
    "tokenizer_vocab_size": "paratron.data.tokenizers",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paratron.data' has no attribute {name!r}")

"""Megatron Core's ``tokenizers.MegatronTokenizer.from_pretrained``: the null tokenizer of Megatron's
examples (``metadata_path={"library": "null-text"}``) as paratron's NullTokenizer; other tokenizers come
from ``paratron.data.tokenizers.build_tokenizer`` with Megatron's tokenizer flags."""
from __future__ import annotations

from ...data.errors import DataError
from ...data.tokenizers import NullTokenizer


class MegatronTokenizer:
    @staticmethod
    def from_pretrained(tokenizer_path: str = None, metadata_path=None, vocab_size: int = None, **kwargs):
        library = (metadata_path or {}).get("library") if isinstance(metadata_path, dict) else None
        if library in ("null-text", "null") and vocab_size:
            return NullTokenizer(int(vocab_size), kwargs.get("eod_id"))
        raise DataError("MegatronTokenizer.from_pretrained: paratron.core has the null tokenizer "
                        "(metadata_path={'library': 'null-text'}, vocab_size=N); build others with "
                        "paratron.data.tokenizers.build_tokenizer")


__all__ = ["MegatronTokenizer"]

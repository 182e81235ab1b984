"""Megatron Core's ``transformer``: TransformerConfig (mapped onto paratron's ModelConfig) and its enums."""
from .enums import AttnBackend
from .transformer_config import TransformerConfig

__all__ = ["AttnBackend", "TransformerConfig"]

"""Megatron Core's ``transformer``: TransformerConfig (mapped onto paratron's ModelConfig)."""
from .transformer_config import TransformerConfig

__all__ = ["TransformerConfig"]

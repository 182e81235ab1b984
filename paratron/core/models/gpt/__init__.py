"""Megatron Core's ``models.gpt``: GPTModel and the layer specs it takes."""
from .gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec
from .gpt_model import GPTModel

__all__ = ["GPTModel", "get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec"]

"""Megatron Core's ``models.bert``: BertModel and the layer specs it takes."""
from .bert_layer_specs import bert_layer_local_spec, bert_layer_with_transformer_engine_spec
from .bert_model import BertModel

__all__ = ["BertModel", "bert_layer_local_spec", "bert_layer_with_transformer_engine_spec"]

"""Megatron Core's ``models.bert.bert_layer_specs``: the two module-level specs of a BERT layer. As for GPT
(``models.gpt.gpt_layer_specs``), a spec records options and paratron's config chooses the layers: a BERT layer
is GPT's pre-norm layer run bidirectionally under the padding mask, with LayerNorm (Megatron's specs use it)."""
from __future__ import annotations

from ..gpt.gpt_layer_specs import LayerSpec

bert_layer_local_spec = LayerSpec(normalization="LayerNorm")
bert_layer_with_transformer_engine_spec = LayerSpec(normalization="LayerNorm")  # no Transformer Engine here

__all__ = ["bert_layer_local_spec", "bert_layer_with_transformer_engine_spec"]

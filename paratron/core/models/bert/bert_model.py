"""Megatron Core's ``BertModel(config, num_tokentypes, transformer_layer_spec, vocab_size, max_sequence_length,
...)``: paratron's BertModel (paratron/model/bert.py) built from the facade's TransformerConfig and the
ParallelDims of ``parallel_state``, with Megatron's forward signature and ``sharded_state_dict()``.

It IS a ``paratron.model.bert.BertModel``: the same parameters and numbers as one built from the resolved
ModelConfig (``--model bert``) with the same seed. ``forward(input_ids, attention_mask, tokentype_ids,
lm_labels)`` returns Megatron's pair on the last pipeline stage: (per-token loss [b, s] or logits [b, s,
vocab / TP], the binary head's logits [b, 2] or None); ``attention_mask`` is the padding mask [b, s]
(1 = a real token), as Megatron's BertModel takes it.
"""
from __future__ import annotations

from typing import Optional

from ....config import ConfigError
from ....model.bert import BertModel as _BertModel
from ..gpt.gpt_layer_specs import LayerSpec
from ..gpt.gpt_model import GPTModel, build_kwargs
from .bert_layer_specs import bert_layer_local_spec


class BertModel(_BertModel):
    def __init__(self, config, num_tokentypes: int, transformer_layer_spec: Optional[LayerSpec] = None,
                 vocab_size: int = 0, max_sequence_length: int = 0, pre_process: bool = True,
                 post_process: bool = True, fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False, position_embedding_type: str = "learned_absolute",
                 rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[float] = None,
                 add_binary_head: bool = True, return_embeddings: bool = False, vp_stage: Optional[int] = None,
                 **_megatron_only):
        refused = [name for name, bad in (("parallel_output=False", not parallel_output),
                                          ("fp16_lm_cross_entropy=True", fp16_lm_cross_entropy),
                                          ("return_embeddings=True", return_embeddings)) if bad]
        if refused:
            raise ConfigError(f"BertModel({refused[0]}) is not supported by paratron.core")
        if num_tokentypes != (2 if add_binary_head else 0):
            raise ConfigError(f"BertModel(num_tokentypes={num_tokentypes}, add_binary_head={add_binary_head}): "
                              "paratron's BERT has 2 token types with the binary head and none without (as "
                              "pretrain_bert.py builds it)")
        spec = transformer_layer_spec if transformer_layer_spec is not None else bert_layer_local_spec
        model_cfg = config.model_config(max_sequence_length, **spec.model_fields(config), model="bert",
                                        bert_no_binary_head=not add_binary_head,
                                        position_embedding_type=position_embedding_type,
                                        untie_embeddings_and_output_weights=not share_embeddings_and_output_weights)
        super().__init__(model_cfg, vocab_size, max_sequence_length, add_binary_head=add_binary_head,
                         **build_kwargs(config, model_cfg, pre_process, post_process, vp_stage))
        self.transformer_config = config

    def forward(self, input_ids, attention_mask, tokentype_ids=None, lm_labels=None, inference_params=None):
        """Megatron's signature and return values (see the module docstring)."""
        if inference_params is not None:
            raise ConfigError("BertModel.forward(inference_params=...) is not supported by paratron.core")
        return super().forward(input_ids, attention_mask, tokentype_ids, lm_labels)

    sharded_state_dict = GPTModel.sharded_state_dict

"""The config fields of the model family (``--model gpt | bert | t5``), BERT's heads and encoder-decoder models
(T5): the two stacks' depths and lengths, T5's relative position buckets and its v1.1 options. Mixed into
:class:`~paratron.config.sections.ModelConfig` (sections.py), which they are part of: the flags are Megatron's
(``--encoder-num-layers`` ...) or paratron's (``--geglu``, ``--softmax-scale``); the help comments are read from
this file too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=True)
class EncoderDecoderFields:
    model: str = "gpt"  # paratron: the model family, gpt | bert | t5 (Megatron: by script, pretrain_bert.py)
    bert_no_binary_head: bool = False  # BERT without the pooler + sentence-order head (and without tokentypes)
    bert_embedder_type: str = "megatron"  # megatron (huggingface: refused, Megatron's retrieval embedder)
    encoder_num_layers: Optional[int] = None  # T5: encoder layers (default --num-layers; Megatron's alias of it)
    decoder_num_layers: Optional[int] = None  # T5: decoder layers (default the encoder's)
    encoder_seq_length: Optional[int] = None  # T5: encoder tokens per sample (default --seq-length)
    decoder_seq_length: Optional[int] = None  # T5: decoder tokens per sample (default the encoder's)
    relative_attention_num_buckets: int = 32  # --position-embedding-type relative: buckets of key-query distance
    relative_attention_max_distance: int = 128  # --position-embedding-type relative: distance of the last bucket
    geglu: bool = False  # paratron: gated GeLU MLP, gelu(gate) * up (T5 v1.1; with --openai-gelu the tanh GeLU)
    softmax_scale: Optional[float] = None  # paratron: the attention scores' scale (default 1/sqrt(head dim); T5: 1)


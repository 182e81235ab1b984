"""Hugging Face <-> paratron conversion of BERT (``--model bert``): transformers' ``MegatronBertForPreTraining``
(with the binary head) and ``MegatronBertForMaskedLM`` (``--bert-no-binary-head``), Megatron's layout.

One fixed table (:func:`bert_name_table`), as paratron/checkpoint/hf.py's for GPT: the fused ``linear_qkv`` <->
``query`` / ``key`` / ``value``, vocabulary rows padded or dropped, everything else copied; with
``--apply-layernorm-1p`` every LayerNorm weight is stored as w here and 1 + w there. A model without the
binary head gets zero ``token_type_embeddings`` in Hugging Face (its type ids add nothing); from Hugging Face,
type 0's row (what every token gets there without type ids) is added to the position table.

``BertForMaskedLM`` (the original BERT) is refused by name: it is post-LayerNorm (a LayerNorm on the
embeddings and after each residual add), which Megatron's pre-LayerNorm BertModel cannot represent.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig
from .hf import _pad_rows, fuse_qkv, split_qkv
from .hf_config import ConversionError

BERT_FAMILIES = ("megatron-bert",)
_LAYER = [
    ("input_layernorm.weight", ("attention.ln.weight",), "norm"),
    ("input_layernorm.bias", ("attention.ln.bias",), "copy"),
    ("self_attention.linear_qkv.weight", tuple(f"attention.self.{n}.weight" for n in ("query", "key", "value")),
     "qkv"),
    ("self_attention.linear_qkv.bias", tuple(f"attention.self.{n}.bias" for n in ("query", "key", "value")), "qkv"),
    ("self_attention.linear_proj.weight", ("attention.output.dense.weight",), "copy"),
    ("self_attention.linear_proj.bias", ("attention.output.dense.bias",), "copy"),
    ("pre_mlp_layernorm.weight", ("ln.weight",), "norm"),
    ("pre_mlp_layernorm.bias", ("ln.bias",), "copy"),
    ("mlp.linear_fc1.weight", ("intermediate.dense.weight",), "copy"),
    ("mlp.linear_fc1.bias", ("intermediate.dense.bias",), "copy"),
    ("mlp.linear_fc2.weight", ("output.dense.weight",), "copy"),
    ("mlp.linear_fc2.bias", ("output.dense.bias",), "copy"),
]
_TOP = [
    ("embedding.word_embeddings.weight", ("bert.embeddings.word_embeddings.weight",), "vocab"),
    ("embedding.position_embeddings.weight", ("bert.embeddings.position_embeddings.weight",), "copy"),
    ("embedding.tokentype_embeddings.weight", ("bert.embeddings.token_type_embeddings.weight",), "copy"),
    ("encoder.final_layernorm.weight", ("bert.encoder.ln.weight",), "norm"),
    ("encoder.final_layernorm.bias", ("bert.encoder.ln.bias",), "copy"),
    ("lm_head.dense.weight", ("cls.predictions.transform.dense.weight",), "copy"),
    ("lm_head.dense.bias", ("cls.predictions.transform.dense.bias",), "copy"),
    ("lm_head.layer_norm.weight", ("cls.predictions.transform.LayerNorm.weight",), "norm"),
    ("lm_head.layer_norm.bias", ("cls.predictions.transform.LayerNorm.bias",), "copy"),
    ("output_layer.weight", ("cls.predictions.decoder.weight",), "vocab"),
    ("output_layer.bias", ("cls.predictions.bias",), "vocab"),
    ("binary_head.weight", ("cls.seq_relationship.weight",), "copy"),
    ("binary_head.bias", ("cls.seq_relationship.bias",), "copy"),
    ("pooler.dense.weight", ("bert.pooler.dense.weight",), "copy"),
    ("pooler.dense.bias", ("bert.pooler.dense.bias",), "copy"),
]


def check_bert_representable(cfg: ModelConfig) -> None:
    problems = [what for bad, what in (
        (cfg.normalization != "LayerNorm", f"--normalization {cfg.normalization}"),
        (cfg.swiglu or cfg.squared_relu or cfg.quick_geglu, "a gated / squared-ReLU MLP"),
        (cfg.openai_gelu, "--openai-gelu"), (cfg.disable_bias_linear, "--disable-bias-linear"),
        (cfg.qk_layernorm, "--qk-layernorm"), (cfg.num_query_groups != cfg.num_attention_heads, "grouped queries"),
        (cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size, "--kv-channels x heads != hidden"),
    ) if bad]
    if problems:
        raise ConversionError(f"transformers' MegatronBert has no {', '.join(problems)}; this BERT cannot be "
                              "converted")


def bert_name_table(cfg: ModelConfig, binary_head: bool) -> list:
    """(paratron name, Hugging Face names, reshape) of every tensor of a one-stage BertModel state dict."""
    check_bert_representable(cfg)
    rows = [r for r in _TOP if binary_head or not r[0].startswith(("embedding.tokentype", "binary_head", "pooler"))]
    if not cfg.untie_embeddings_and_output_weights:
        rows = [r for r in rows if r[0] != "output_layer.weight"]
    for i in range(cfg.num_layers):
        rows += [(f"encoder.layers.{i}.{p}", tuple(f"bert.encoder.layer.{i}.{n}" for n in hf), how)
                 for p, hf, how in _LAYER]
    return rows


def _to_paratron(how: str, ts: list, cfg: ModelConfig, padded: int) -> torch.Tensor:
    if how == "qkv":
        return fuse_qkv(*ts, cfg.num_attention_heads, cfg.num_query_groups)
    if how == "vocab":
        return _pad_rows(ts[0], padded)
    if how == "norm" and cfg.apply_layernorm_1p:
        return ts[0] - 1.0
    return ts[0]


def _to_hf(how: str, t: torch.Tensor, cfg: ModelConfig, vocab: int) -> list:
    if how == "qkv":
        return list(split_qkv(t, cfg.num_attention_heads, cfg.num_query_groups))
    if how == "vocab":
        return [t[:vocab]]
    if how == "norm" and cfg.apply_layernorm_1p:
        return [t + 1.0]
    return [t]


def bert_hf_to_paratron(hf_state: dict, cfg: ModelConfig, padded_vocab: int, binary_head: bool = True) -> dict:
    hf_state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in hf_state.items()}
    out = {}
    for p, names, how in bert_name_table(cfg, binary_head):
        missing = [n for n in names if n not in hf_state]
        if missing:
            raise ConversionError(f"the Hugging Face checkpoint has no {missing[0]} (needed for paratron's {p})")
        out[p] = _to_paratron(how, [hf_state[n] for n in names], cfg, padded_vocab)
    types = hf_state.get("bert.embeddings.token_type_embeddings.weight")
    if not binary_head and types is not None:  # Hugging Face adds type 0's row to every token: into the positions
        out["embedding.position_embeddings.weight"] = out["embedding.position_embeddings.weight"] + types[0]
    return out


def bert_paratron_to_hf(state: dict, cfg: ModelConfig, vocab: int, binary_head: bool = True) -> dict:
    out = {}
    for p, names, how in bert_name_table(cfg, binary_head):
        if p not in state:
            raise ConversionError(f"the paratron checkpoint has no {p}: not a BERT of this configuration")
        out.update(zip(names, _to_hf(how, state[p], cfg, vocab)))
    word = out["bert.embeddings.word_embeddings.weight"]
    out.setdefault("cls.predictions.decoder.weight", word)  # tied: the same tensor
    if not binary_head:  # Hugging Face's embeddings always have two token types
        out["bert.embeddings.token_type_embeddings.weight"] = word.new_zeros(2, cfg.hidden_size)
    return out


def bert_config_from_hf(d: dict) -> tuple[ModelConfig, int, bool]:
    """(ModelConfig with --model bert, vocabulary size, binary head) of a MegatronBert config.json."""
    kind = d.get("model_type")
    if kind == "bert":
        raise ConversionError("BertForMaskedLM / BertForPreTraining (model_type bert) are post-LayerNorm: Megatron's "
                              "pre-LayerNorm BertModel cannot represent them; paratron converts megatron-bert only")
    if kind != "megatron-bert":
        raise ConversionError(f"model_type {kind!r} is not a BERT paratron converts (megatron-bert)")
    if d.get("hidden_act", "gelu") != "gelu" or d.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError("MegatronBert with hidden_act other than gelu or relative positions is not supported")
    if int(d.get("type_vocab_size", 2)) != 2:
        raise ConversionError(f"type_vocab_size {d.get('type_vocab_size')}: Megatron's BERT has 2 token types")
    h, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    positions = int(d.get("max_position_embeddings", 512))
    arch = (d.get("architectures") or ["MegatronBertForPreTraining"])[0]
    binary = arch != "MegatronBertForMaskedLM"
    cfg = ModelConfig(model="bert", num_layers=int(d["num_hidden_layers"]), hidden_size=h, num_attention_heads=heads,
                      ffn_hidden_size=int(d.get("intermediate_size", 4 * h)), kv_channels=h // heads,
                      seq_length=positions, max_position_embeddings=positions, norm_epsilon=float(
                          d.get("layer_norm_eps", 1e-12)), hidden_dropout=float(d.get("hidden_dropout_prob", 0.1)),
                      attention_dropout=float(d.get("attention_probs_dropout_prob", 0.1)),
                      init_method_std=float(d.get("initializer_range", 0.02)), bert_no_binary_head=not binary,
                      untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", True))
    return cfg.resolved(), int(d["vocab_size"]), binary


def hf_bert_config(cfg: ModelConfig, vocab: int) -> dict[str, Any]:
    binary = not cfg.bert_no_binary_head
    return {"architectures": ["MegatronBertForPreTraining" if binary else "MegatronBertForMaskedLM"],
            "model_type": "megatron-bert", "vocab_size": vocab, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "intermediate_size": cfg.ffn_hidden_size, "hidden_act": "gelu",
            "hidden_dropout_prob": cfg.hidden_dropout, "attention_probs_dropout_prob": cfg.attention_dropout,
            "max_position_embeddings": cfg.max_position_embeddings, "type_vocab_size": 2,
            "initializer_range": cfg.init_method_std, "layer_norm_eps": cfg.norm_epsilon,
            "position_embedding_type": "absolute", "pad_token_id": 0,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights}


def save_bert_hf_dir(path, state: dict, cfg: ModelConfig, vocab: int, dtype=None, extra_config=None):
    """A Hugging Face MegatronBert directory (model.safetensors + config.json) of a paratron BERT state, written as
    every Hugging Face export is (checkpoint/hf.py's write_hf_dir: into a new or empty directory)."""
    from .hf import write_hf_dir
    hf = bert_paratron_to_hf(state, cfg, vocab, not cfg.bert_no_binary_head)
    if not cfg.untie_embeddings_and_output_weights:  # tied: transformers ties the decoder to the embedding
        hf.pop("cls.predictions.decoder.weight")
    return write_hf_dir(path, hf, hf_bert_config(cfg, vocab), "bert.embeddings.word_embeddings.weight", dtype,
                        extra_config)

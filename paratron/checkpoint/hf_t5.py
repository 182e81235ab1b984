"""Hugging Face ``T5ForConditionalGeneration`` (T5 v1.1 style) <-> paratron's T5Model, both ways.

The layouts that convert: untied LM head without Hugging Face's decoder-output rescaling, RMSNorm, no biases,
gated GeLU (``feed_forward_proj`` ``gated-gelu``: the tanh GeLU), relative position buckets, unscaled
attention scores (``--softmax-scale 1``). The table of names:

==========================================================  ===============================================
Hugging Face                                                paratron
==========================================================  ===============================================
``shared.weight``                                           ``embedding.word_embeddings.weight`` (padded rows)
``{enc,dec}oder.block.0.layer.0.SelfAttention.``            ``{enc,dec}oder_relative_pos_emb.``
``relative_attention_bias.weight``                          ``relative_attention_bias.weight``
``*.block.i.layer.0.SelfAttention.{q,k,v}.weight``          ``*.layers.i.self_attention.linear_qkv.weight``
``*.block.i.layer.0.SelfAttention.o.weight``                ``*.layers.i.self_attention.linear_proj.weight``
``*.block.i.layer.0.layer_norm.weight``                     ``*.layers.i.input_layernorm.weight``
``decoder.block.i.layer.1.EncDecAttention.q.weight``        ``decoder.layers.i.cross_attention.linear_q.weight``
``decoder.block.i.layer.1.EncDecAttention.{k,v}.weight``    ``decoder.layers.i.cross_attention.linear_kv.weight``
``decoder.block.i.layer.1.EncDecAttention.o.weight``        ``decoder.layers.i.cross_attention.linear_proj.weight``
``decoder.block.i.layer.1.layer_norm.weight``               ``decoder.layers.i.pre_cross_attn_layernorm.weight``
``*.block.i.layer.-1.DenseReluDense.wi_0 / wi_1``           ``*.layers.i.mlp.linear_fc1.weight`` ([gate; up])
``*.block.i.layer.-1.DenseReluDense.wo.weight``             ``*.layers.i.mlp.linear_fc2.weight``
``*.block.i.layer.-1.layer_norm.weight``                    ``*.layers.i.pre_mlp_layernorm.weight``
``{enc,dec}oder.final_layer_norm.weight``                   ``{enc,dec}oder.final_layernorm.weight``
``lm_head.weight``                                          ``output_layer.weight`` (padded rows)
==========================================================  ===============================================
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig
from .hf import _pad_rows, fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from .hf_config import ConversionError, _as_dict


def model_config_from_t5(hf_config: Any, seq_length: int = 512) -> ModelConfig:
    """A T5 v1.1 ``config.json`` -> paratron's (unresolved) ModelConfig; refuses what paratron computes otherwise."""
    d = _as_dict(hf_config)
    act = d.get("feed_forward_proj", "relu")
    if act != "gated-gelu":
        raise ConversionError(f"T5 feed_forward_proj {act!r}: paratron converts T5 v1.1's gated-gelu")
    # transformers 5 says it with scale_decoder_outputs; older config.json files with tie_word_embeddings
    scaled = d["scale_decoder_outputs"] if "scale_decoder_outputs" in d else d.get("tie_word_embeddings", True)
    if scaled:
        raise ConversionError("this T5 rescales the decoder output by d_model**-0.5 before its LM head (original T5), "
                              "which paratron's T5 does not: convert T5 v1.1 style checkpoints (tie_word_embeddings "
                              "false)")
    layers = d["num_layers"]
    return ModelConfig(
        num_layers=layers, encoder_num_layers=layers, decoder_num_layers=d.get("num_decoder_layers") or layers,
        hidden_size=d["d_model"], kv_channels=d["d_kv"], ffn_hidden_size=d["d_ff"], num_attention_heads=d["num_heads"],
        seq_length=seq_length, max_position_embeddings=seq_length, position_embedding_type="relative",
        relative_attention_num_buckets=d.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=d.get("relative_attention_max_distance", 128),
        normalization="RMSNorm", norm_epsilon=d.get("layer_norm_epsilon", 1e-6), geglu=True, openai_gelu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True, softmax_scale=1.0, hidden_dropout=d.get("dropout_rate", 0.1),
        attention_dropout=d.get("dropout_rate", 0.1), make_vocab_size_divisible_by=128)


def t5_config_from_model_config(cfg: ModelConfig, vocab_size: int) -> dict:
    """paratron's T5 ModelConfig -> a ``config.json`` for ``T5ForConditionalGeneration``."""
    check_t5_representable(cfg)
    enc = cfg.encoder_num_layers or cfg.num_layers
    return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": vocab_size,
            "d_model": cfg.hidden_size, "d_kv": cfg.kv_channels, "d_ff": cfg.ffn_hidden_size, "num_layers": enc,
            "num_decoder_layers": cfg.decoder_num_layers or enc, "num_heads": cfg.num_attention_heads,
            "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
            "relative_attention_max_distance": cfg.relative_attention_max_distance,
            "dropout_rate": cfg.hidden_dropout, "layer_norm_epsilon": cfg.norm_epsilon,
            "feed_forward_proj": "gated-gelu", "is_encoder_decoder": True,
            "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}


def check_t5_representable(cfg: ModelConfig) -> None:
    """One line naming what a Hugging Face T5 cannot hold."""
    problems = [what for what, bad in (
        ("--position-embedding-type relative", cfg.position_embedding_type != "relative"),
        ("--normalization RMSNorm", cfg.normalization != "RMSNorm"), ("--disable-bias-linear", not cfg.disable_bias_linear),
        ("--untie-embeddings-and-output-weights", not cfg.untie_embeddings_and_output_weights),
        ("--softmax-scale 1", cfg.softmax_scale != 1.0), ("--geglu --openai-gelu", not (cfg.geglu and cfg.openai_gelu)),
        ("no --apply-layernorm-1p", cfg.apply_layernorm_1p), ("no --qk-layernorm", cfg.qk_layernorm),
        ("no grouped-query attention", cfg.num_query_groups not in (None, cfg.num_attention_heads))) if bad]
    if problems:
        raise ConversionError(f"a Hugging Face T5 (v1.1) needs {', '.join(problems)}")


def _stacks(cfg: ModelConfig) -> tuple[int, int]:
    enc = cfg.encoder_num_layers or cfg.num_layers
    return enc, cfg.decoder_num_layers or enc


def _kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Separate k, v [heads*d, h] -> paratron's linear_kv: per head its key rows, then its value rows."""
    d = k.shape[0] // heads
    return torch.stack([k.reshape(heads, d, -1), v.reshape(heads, d, -1)], dim=1).reshape(2 * heads * d, -1)


def _split_kv(kv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = kv.reshape(heads, 2, kv.shape[0] // (2 * heads), -1)
    return g[:, 0].reshape(-1, kv.shape[1]).contiguous(), g[:, 1].reshape(-1, kv.shape[1]).contiguous()


def _layer_pairs(stack: str, i: int, decoder: bool) -> list[tuple[str, str]]:
    """(paratron, Hugging Face) prefixes of one layer's plain copies."""
    hf, p = f"{stack}.block.{i}.layer", f"{stack}.layers.{i}"
    mlp = 2 if decoder else 1
    pairs = [(f"{p}.input_layernorm.weight", f"{hf}.0.layer_norm.weight"),
             (f"{p}.self_attention.linear_proj.weight", f"{hf}.0.SelfAttention.o.weight"),
             (f"{p}.pre_mlp_layernorm.weight", f"{hf}.{mlp}.layer_norm.weight"),
             (f"{p}.mlp.linear_fc2.weight", f"{hf}.{mlp}.DenseReluDense.wo.weight")]
    if decoder:
        pairs += [(f"{p}.pre_cross_attn_layernorm.weight", f"{hf}.1.layer_norm.weight"),
                  (f"{p}.cross_attention.linear_q.weight", f"{hf}.1.EncDecAttention.q.weight"),
                  (f"{p}.cross_attention.linear_proj.weight", f"{hf}.1.EncDecAttention.o.weight")]
    return pairs


def _plain_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(paratron, Hugging Face) names of every tensor copied as it is."""
    out = []
    for stack, n in zip(("encoder", "decoder"), _stacks(cfg)):
        out += [(f"{stack}_relative_pos_emb.relative_attention_bias.weight",
                 f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
                (f"{stack}.final_layernorm.weight", f"{stack}.final_layer_norm.weight")]
        out += [pair for i in range(n) for pair in _layer_pairs(stack, i, stack == "decoder")]
    return out


def _layers(cfg: ModelConfig):
    """(decoder?, Hugging Face prefix, paratron prefix, MLP sublayer) of every layer of both stacks."""
    for stack, n in zip(("encoder", "decoder"), _stacks(cfg)):
        for i in range(n):
            dec = stack == "decoder"
            yield dec, f"{stack}.block.{i}.layer", f"{stack}.layers.{i}", f"{stack}.block.{i}.layer.{2 if dec else 1}"


def t5_to_paratron(hf: dict, cfg: ModelConfig, padded_vocab_size: int) -> dict:
    """A T5ForConditionalGeneration state dict -> paratron T5Model's (TP 1)."""
    heads = cfg.num_attention_heads
    out = {mine: hf[theirs] for mine, theirs in _plain_pairs(cfg)}
    out["embedding.word_embeddings.weight"] = _pad_rows(hf["shared.weight"], padded_vocab_size)
    out["output_layer.weight"] = _pad_rows(hf.get("lm_head.weight", hf["shared.weight"]), padded_vocab_size)
    for dec, hfl, p, mlp in _layers(cfg):
        att = f"{hfl}.0.SelfAttention"
        out[f"{p}.self_attention.linear_qkv.weight"] = fuse_qkv(*(hf[f"{att}.{x}.weight"] for x in "qkv"), heads,
                                                                heads)
        ff = f"{mlp}.DenseReluDense"
        out[f"{p}.mlp.linear_fc1.weight"] = fuse_gate_up(hf[f"{ff}.wi_0.weight"], hf[f"{ff}.wi_1.weight"])
        if dec:
            cross = f"{hfl}.1.EncDecAttention"
            out[f"{p}.cross_attention.linear_kv.weight"] = _kv(hf[f"{cross}.k.weight"], hf[f"{cross}.v.weight"],
                                                               heads)
    return {k: v.clone() for k, v in out.items()}


def paratron_to_t5(state: dict, cfg: ModelConfig, vocab_size: int) -> dict:
    """paratron T5Model's state dict (TP 1) -> T5ForConditionalGeneration's."""
    check_t5_representable(cfg)
    heads = cfg.num_attention_heads
    out = {theirs: state[mine] for mine, theirs in _plain_pairs(cfg)}
    out["shared.weight"] = state["embedding.word_embeddings.weight"][:vocab_size]
    out["lm_head.weight"] = state["output_layer.weight"][:vocab_size]
    out["encoder.embed_tokens.weight"] = out["decoder.embed_tokens.weight"] = out["shared.weight"]
    for dec, hfl, p, mlp in _layers(cfg):
        q, k, v = split_qkv(state[f"{p}.self_attention.linear_qkv.weight"], heads, heads)
        out.update({f"{hfl}.0.SelfAttention.{x}.weight": t for x, t in zip("qkv", (q, k, v))})
        ff = f"{mlp}.DenseReluDense"
        out[f"{ff}.wi_0.weight"], out[f"{ff}.wi_1.weight"] = split_gate_up(state[f"{p}.mlp.linear_fc1.weight"])
        if dec:
            k, v = _split_kv(state[f"{p}.cross_attention.linear_kv.weight"], heads)
            out[f"{hfl}.1.EncDecAttention.k.weight"], out[f"{hfl}.1.EncDecAttention.v.weight"] = k, v
    return {k: v.contiguous().clone() for k, v in out.items()}


def save_t5_hf_dir(path, state: dict, cfg: ModelConfig, vocab_size: int, dtype=None, extra_config=None):
    """A Hugging Face T5ForConditionalGeneration directory (model.safetensors + config.json) of a paratron T5."""
    from .hf import write_hf_dir
    return write_hf_dir(path, paratron_to_t5(state, cfg, vocab_size), t5_config_from_model_config(cfg, vocab_size),
                        "shared.weight", dtype, extra_config)


def t5_state_from_hf(hf_config: dict, hf_state: dict, tp: int = 1):
    """(ModelConfig of --model t5, vocabulary, paratron state, padded vocabulary) of a Hugging Face T5."""
    from .hf_config import padded_vocab_size
    m = model_config_from_t5(hf_config)
    m.model = "t5"
    vocab = int(hf_config["vocab_size"])
    padded = padded_vocab_size(vocab, m, tp)
    return m, vocab, t5_to_paratron(hf_state, m, padded), padded

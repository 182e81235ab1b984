"""Hugging Face <-> paratron checkpoint conversion (GPT-2, Llama, Mistral, Qwen2, Qwen3).

The whole mapping is one fixed table (:func:`name_table`): every paratron tensor has one row naming
the Hugging Face tensor(s) it comes from and how it is reshaped. Most rows are plain copies; the few
reshapes are small functions in this file:

* ``conv1d``  GPT-2's ``Conv1D`` stores ``[in, out]``; paratron (``nn.Linear``) stores ``[out, in]``:
  a transpose (1-D biases are copied).
* ``c_attn``  GPT-2's fused ``c_attn`` is ``[q | k | v]`` along its output; paratron's ``linear_qkv`` is
  laid out by query group (:func:`fuse_qkv`), so the three blocks are split and regrouped.
* ``qkv``     Llama-style separate ``q_proj``/``k_proj``/``v_proj`` <-> the grouped fused ``linear_qkv``.
* ``gate_up`` ``gate_proj`` and ``up_proj`` stacked as paratron's SwiGLU ``linear_fc1`` = ``[gate; up]``.
* ``vocab``   embedding / output rows: Hugging Face has exactly ``vocab_size`` rows, paratron the padded
  size; converting to paratron appends zero rows, converting back drops them.

Everything here works on plain ``{name: tensor}`` dicts of a full (TP=1, single pipeline stage)
model, reads and writes local files only, and never imports ``transformers``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import ModelConfig

__all__ = [
    "ConversionError", "FAMILIES", "family_of", "model_config_from_hf", "hf_config_from_model_config", "name_table",
    "hf_to_paratron", "paratron_to_hf", "save_hf_dir", "load_hf_dir", "padded_vocab_size",
    "fuse_qkv", "split_qkv", "c_attn_to_qkv", "qkv_to_c_attn", "fuse_gate_up", "split_gate_up",
]


class ConversionError(ValueError):
    """The checkpoint or config cannot be converted; the message is one line naming what and why."""


FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# paratron's Llama-3 rope scaling has these fixed (paratron/model/layers.py: rope_inv_freq).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# ----------------------------------------------------------------------------------------------
# The name table
# ----------------------------------------------------------------------------------------------

# (paratron name inside a block, Hugging Face name(s) inside a block, reshape)
_GPT2_LAYER = [
    ("input_layernorm.weight", ("ln_1.weight",), "copy"),
    ("input_layernorm.bias", ("ln_1.bias",), "copy"),
    ("self_attention.linear_qkv.weight", ("attn.c_attn.weight",), "c_attn"),
    ("self_attention.linear_qkv.bias", ("attn.c_attn.bias",), "c_attn"),
    ("self_attention.linear_proj.weight", ("attn.c_proj.weight",), "conv1d"),
    ("self_attention.linear_proj.bias", ("attn.c_proj.bias",), "copy"),
    ("pre_mlp_layernorm.weight", ("ln_2.weight",), "copy"),
    ("pre_mlp_layernorm.bias", ("ln_2.bias",), "copy"),
    ("mlp.linear_fc1.weight", ("mlp.c_fc.weight",), "conv1d"),
    ("mlp.linear_fc1.bias", ("mlp.c_fc.bias",), "copy"),
    ("mlp.linear_fc2.weight", ("mlp.c_proj.weight",), "conv1d"),
    ("mlp.linear_fc2.bias", ("mlp.c_proj.bias",), "copy"),
]
_GPT2_TOP = [
    ("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab"),
    ("embedding.position_embeddings.weight", ("transformer.wpe.weight",), "copy"),
    ("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), "copy"),
    ("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), "copy"),
    ("output_layer.weight", ("lm_head.weight",), "vocab"),
]

# Llama, Mistral, Qwen2 and Qwen3 share names; each uses the rows its configuration has tensors for
# (biases only where the config has them, q_norm/k_norm only in Qwen3).
_LLAMA_LAYER = [
    ("input_layernorm.weight", ("input_layernorm.weight",), "copy"),
    ("self_attention.linear_qkv.weight",
     ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    ("self_attention.linear_qkv.bias",
     ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "copy"),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "copy"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "copy"),
    ("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), "copy"),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy"),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    ("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), "gate_up"),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "copy"),
    ("mlp.linear_fc2.bias", ("mlp.down_proj.bias",), "copy"),
]
_LLAMA_TOP = [
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    ("output_layer.weight", ("lm_head.weight",), "vocab"),
]

_TABLES = {"gpt2": (_GPT2_TOP, "transformer.h.{i}.", _GPT2_LAYER)}
for _fam in ("llama", "mistral", "qwen2", "qwen3"):
    _TABLES[_fam] = (_LLAMA_TOP, "model.layers.{i}.", _LLAMA_LAYER)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ConversionError(f"unsupported model family {family!r}; paratron converts {', '.join(FAMILIES)}")


def _paratron_shapes(cfg: ModelConfig, padded_vocab: int) -> dict[str, tuple]:
    """Every tensor of GPTModel(cfg, padded_vocab).state_dict() at TP=1, with its shape."""
    cfg.fill_defaults()
    h, d, ffn = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    norm_bias = cfg.normalization == "LayerNorm"
    bias = not cfg.disable_bias_linear
    out = {"embedding.word_embeddings.weight": (padded_vocab, h)}
    if cfg.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (cfg.max_position_embeddings, h)

    def norm(name, size):
        out[name + ".weight"] = (size,)
        if norm_bias:
            out[name + ".bias"] = (size,)

    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        norm(p + "input_layernorm", h)
        out[p + "self_attention.linear_qkv.weight"] = ((heads + 2 * groups) * d, h)
        if bias or cfg.add_qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = ((heads + 2 * groups) * d,)
        if cfg.qk_layernorm:
            norm(p + "self_attention.q_layernorm", d)
            norm(p + "self_attention.k_layernorm", d)
        out[p + "self_attention.linear_proj.weight"] = (h, heads * d)
        if bias:
            out[p + "self_attention.linear_proj.bias"] = (h,)
        norm(p + "pre_mlp_layernorm", h)
        fc1 = ffn * (2 if cfg.swiglu else 1)
        out[p + "mlp.linear_fc1.weight"] = (fc1, h)
        if bias:
            out[p + "mlp.linear_fc1.bias"] = (fc1,)
        out[p + "mlp.linear_fc2.weight"] = (h, ffn)
        if bias:
            out[p + "mlp.linear_fc2.bias"] = (h,)
    norm("decoder.final_layernorm", h)
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = (padded_vocab, h)
    return out


def name_table(cfg: ModelConfig, family: str) -> list[tuple[str, tuple[str, ...], str]]:
    """The mapping for one model: ``(paratron name, Hugging Face names, reshape)`` for every paratron
    tensor, in state-dict order. Reshape is one of copy, conv1d, c_attn, qkv, gate_up, vocab."""
    _check_family(family)
    _check_representable(cfg, family)
    top, layer_prefix, layer = _TABLES[family]
    by_name = {p: (hf, how) for p, hf, how in top}
    for i in range(cfg.num_layers):
        hp = layer_prefix.format(i=i)
        for p, hf, how in layer:
            by_name[f"decoder.layers.{i}.{p}"] = (tuple(hp + n for n in hf), how)
    rows = []
    for p in _paratron_shapes(cfg, 1):
        if p not in by_name:  # _check_representable should make this unreachable
            raise ConversionError(f"{family} has no tensor for paratron's {p}")
        rows.append((p, *by_name[p]))
    return rows


# ----------------------------------------------------------------------------------------------
# Reshaping functions
# ----------------------------------------------------------------------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """Separate q [heads*d, ...], k and v [groups*d, ...] -> paratron's fused rows, laid out by query
    group: for each group its heads/groups query heads, then its key head, then its value head."""
    d = q.shape[0] // num_heads
    rest = q.shape[1:]
    qg = q.reshape(num_groups, num_heads // num_groups, d, *rest)
    kg = k.reshape(num_groups, 1, d, *rest)
    vg = v.reshape(num_groups, 1, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape((num_heads + 2 * num_groups) * d, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: paratron's grouped fused rows -> (q, k, v)."""
    per = num_heads // num_groups + 2
    d = qkv.shape[0] // (num_groups * per)
    rest = qkv.shape[1:]
    g = qkv.reshape(num_groups, per, d, *rest)
    q = g[:, : per - 2].reshape(num_heads * d, *rest)
    k = g[:, per - 2].reshape(num_groups * d, *rest)
    v = g[:, per - 1].reshape(num_groups * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def c_attn_to_qkv(c_attn: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GPT-2 ``c_attn`` (Conv1D weight [h, 3h] or bias [3h], columns q|k|v) -> paratron linear_qkv."""
    t = c_attn.t() if c_attn.dim() == 2 else c_attn
    q, k, v = t.chunk(3, dim=0)
    return fuse_qkv(q, k, v, num_heads, num_heads).contiguous()


def qkv_to_c_attn(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of :func:`c_attn_to_qkv`."""
    t = torch.cat(split_qkv(qkv, num_heads, num_heads), dim=0)
    return (t.t() if t.dim() == 2 else t).contiguous()


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's gate_proj and up_proj -> paratron's SwiGLU linear_fc1 ([gate; up] along rows)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def _to_paratron(how: str, ts: list, cfg: ModelConfig, padded_vocab: int) -> torch.Tensor:
    if how == "copy":
        return ts[0]
    if how == "conv1d":
        return ts[0].t() if ts[0].dim() == 2 else ts[0]
    if how == "c_attn":
        return c_attn_to_qkv(ts[0], cfg.num_attention_heads)
    if how == "qkv":
        return fuse_qkv(*ts, cfg.num_attention_heads, cfg.num_query_groups)
    if how == "gate_up":
        return fuse_gate_up(*ts)
    if how == "vocab":
        return _pad_rows(ts[0], padded_vocab)
    raise AssertionError(how)


def _to_hf(how: str, t: torch.Tensor, cfg: ModelConfig, vocab_size: int) -> list:
    if how == "copy":
        return [t]
    if how == "conv1d":
        return [t.t() if t.dim() == 2 else t]
    if how == "c_attn":
        return [qkv_to_c_attn(t, cfg.num_attention_heads)]
    if how == "qkv":
        return list(split_qkv(t, cfg.num_attention_heads, cfg.num_query_groups))
    if how == "gate_up":
        return list(split_gate_up(t))
    if how == "vocab":
        return [t[:vocab_size]]
    raise AssertionError(how)


def _hf_shapes(how: str, pshape: tuple, cfg: ModelConfig, vocab_size: int) -> list[tuple]:
    """The Hugging Face shapes that a paratron tensor of shape ``pshape`` comes from."""
    rest = tuple(pshape[1:])
    d, heads, groups = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    if how == "copy":
        return [tuple(pshape)]
    if how == "conv1d":
        return [tuple(reversed(pshape))]
    if how == "c_attn":
        return [(rest[0], pshape[0])] if rest else [tuple(pshape)]
    if how == "qkv":
        return [(heads * d, *rest), (groups * d, *rest), (groups * d, *rest)]
    if how == "gate_up":
        return [(pshape[0] // 2, *rest)] * 2
    if how == "vocab":
        return [(vocab_size, *rest)]
    raise AssertionError(how)


# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------

def padded_vocab_size(vocab_size: int, cfg: ModelConfig, tensor_model_parallel_size: int = 1) -> int:
    """Megatron's padding: the next multiple of make_vocab_size_divisible_by x TP."""
    multiple = cfg.make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _as_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, dict):
        return hf_config
    if hasattr(hf_config, "to_dict"):  # a transformers PretrainedConfig
        return hf_config.to_dict()
    raise ConversionError(f"expected a config.json dict, got {type(hf_config).__name__}")


def family_of(hf_config: Any) -> str:
    """The family of a Hugging Face config (its ``model_type``)."""
    d = _as_dict(hf_config)
    mt = d.get("model_type")
    if mt is None:
        raise ConversionError("config has no model_type; paratron converts " + ", ".join(FAMILIES))
    if mt not in FAMILIES:
        raise ConversionError(f"unsupported model_type {mt!r}; paratron converts {', '.join(FAMILIES)}")
    return mt


def _need(d: dict, *names: str):
    for n in names:
        if d.get(n) is not None:
            return d[n]
    raise ConversionError(f"config.json has no {names[0]!r}")


def _rope_params(d: dict) -> dict:
    """RoPE settings from either the transformers-5 ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` keys (the latter wins, as in transformers)."""
    params = {}
    for key in ("rope_parameters", "rope_scaling"):
        v = d.get(key)
        if v is None:
            continue
        if not isinstance(v, dict) or any(isinstance(x, dict) for x in v.values()):
            raise ConversionError(f"{key} {v!r} is not supported: paratron has one RoPE setting for all layers")
        params.update(v)
    params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def model_config_from_hf(hf_config: Any) -> tuple[ModelConfig, int, str]:
    """A Hugging Face config (config.json dict or PretrainedConfig) -> (ModelConfig, vocab_size, family).

    ``seq_length`` is set to the longest sequence paratron can run identically to the original:
    ``max_position_embeddings``, or the sliding-window size where the model has one (paratron has
    full causal attention only). Dropouts come from the config: GPT-2's resid_pdrop -> hidden_dropout
    (paratron also applies it after the embedding, where GPT-2 has embd_pdrop), attn_pdrop ->
    attention_dropout; Llama-family attention_dropout -> attention_dropout, hidden_dropout 0.
    """
    d = _as_dict(hf_config)
    family = family_of(d)
    vocab = int(_need(d, "vocab_size"))
    if family == "gpt2":
        return _gpt2_config(d), vocab, family
    return _llama_config(d, family), vocab, family


def _gpt2_config(d: dict) -> ModelConfig:
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ConversionError(f"GPT-2 activation_function {act!r} is not supported (gelu_new or gelu)")
    if d.get("scale_attn_weights", True) is not True:
        raise ConversionError("GPT-2 scale_attn_weights=false is not supported (paratron scales by 1/sqrt(d))")
    if d.get("scale_attn_by_inverse_layer_idx", False):
        raise ConversionError("GPT-2 scale_attn_by_inverse_layer_idx=true is not supported")
    if d.get("add_cross_attention", False):
        raise ConversionError("GPT-2 add_cross_attention=true is not supported (decoder-only models only)")
    h = int(_need(d, "n_embd", "hidden_size"))
    heads = int(_need(d, "n_head", "num_attention_heads"))
    positions = int(_need(d, "n_positions", "max_position_embeddings"))
    cfg = ModelConfig(
        num_layers=int(_need(d, "n_layer", "num_hidden_layers")), hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=int(d.get("n_inner") or 4 * h), kv_channels=h // heads,
        seq_length=positions, max_position_embeddings=positions, position_embedding_type="learned_absolute",
        normalization="LayerNorm", norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)), swiglu=False,
        openai_gelu=act != "gelu", disable_bias_linear=False,
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", True),
        hidden_dropout=float(d.get("resid_pdrop", 0.1)), attention_dropout=float(d.get("attn_pdrop", 0.1)),
        init_method_std=float(d.get("initializer_range", 0.02)),
    )
    return cfg.fill_defaults()


def _llama_config(d: dict, family: str) -> ModelConfig:
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConversionError(f"{family} hidden_act {act!r} is not supported (paratron's SwiGLU uses silu)")
    h = int(_need(d, "hidden_size"))
    heads = int(_need(d, "num_attention_heads"))
    kv_heads = int(d.get("num_key_value_heads") or heads)
    head_dim = int(d.get("head_dim") or h // heads)
    positions = int(d.get("max_position_embeddings", 2048))
    rope = _rope_params(d)
    partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ConversionError(f"partial_rotary_factor {partial} is not supported for {family}")
    scaling, factor = False, 8.0
    if rope["rope_type"] == "llama3":
        scaling, factor = True, float(_need(rope, "factor"))
        for key, fixed in _LLAMA3_FIXED.items():
            got = rope.get(key, positions if key == "original_max_position_embeddings" else None)
            if got is None or float(got) != fixed:
                raise ConversionError(f"llama3 rope scaling with {key}={got} is not supported: paratron fixes "
                                      f"{key}={fixed:g}")
    elif rope["rope_type"] != "default":
        raise ConversionError(f"rope type {rope['rope_type']!r} is not supported; paratron has default and llama3")

    qk_norm = family == "qwen3"
    if family == "qwen2":  # q/k/v biases only
        disable_bias, qkv_bias = True, True
    elif family in ("llama", "qwen3"):
        attn_bias = bool(d.get("attention_bias", False))
        mlp_bias = bool(d.get("mlp_bias", False)) if family == "llama" else False
        if attn_bias != mlp_bias:
            raise ConversionError(f"{family} with attention_bias={attn_bias} and mlp_bias={mlp_bias} is not "
                                  "supported: paratron has biases on all linear layers or on none (but q/k/v)")
        disable_bias, qkv_bias = not attn_bias, False
    else:  # mistral
        disable_bias, qkv_bias = True, False

    seq = positions
    window = d["sliding_window"] if "sliding_window" in d else (4096 if family == "mistral" else None)
    uses_window = window is not None and (
        family == "mistral"
        or (family in ("qwen2", "qwen3") and d.get("use_sliding_window", False)
            and "sliding_attention" in (d.get("layer_types") or ["sliding_attention"])))
    if uses_window:
        seq = min(seq, int(window))

    cfg = ModelConfig(
        num_layers=int(_need(d, "num_hidden_layers")), hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=int(_need(d, "intermediate_size")), kv_channels=head_dim,
        group_query_attention=kv_heads != heads, num_query_groups=kv_heads,
        seq_length=seq, max_position_embeddings=positions, position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]), rotary_percent=1.0,
        use_rope_scaling=scaling, rope_scaling_factor=factor,
        normalization="RMSNorm", norm_epsilon=float(d.get("rms_norm_eps", 1e-6)), swiglu=True,
        qk_layernorm=qk_norm, disable_bias_linear=disable_bias, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(d.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(d.get("initializer_range", 0.02)),
    )
    return cfg.fill_defaults()


def _check_representable(cfg: ModelConfig, family: str) -> None:
    """Raise when the paratron model has something the Hugging Face family cannot express."""
    cfg.fill_defaults()

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConversionError(f"{family} cannot represent this model: {what}")

    need(cfg.rotary_percent == 1.0 or cfg.position_embedding_type != "rope", "needs --rotary-percent 1.0")
    if family == "gpt2":
        need(cfg.position_embedding_type == "learned_absolute", "needs --position-embedding-type learned_absolute")
        need(cfg.normalization == "LayerNorm", "needs --normalization LayerNorm")
        need(not cfg.swiglu, "SwiGLU is not available (GeLU MLP only)")
        need(not cfg.disable_bias_linear, "needs biases (remove --disable-bias-linear)")
        need(cfg.num_query_groups == cfg.num_attention_heads, "no grouped-query attention")
        need(cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size,
             "needs --kv-channels = hidden size / heads")
        need(not cfg.qk_layernorm, "no --qk-layernorm")
        return
    need(cfg.position_embedding_type == "rope", "needs --position-embedding-type rope")
    need(cfg.normalization == "RMSNorm", "needs --normalization RMSNorm")
    need(cfg.swiglu, "needs --swiglu")
    need(cfg.qk_layernorm == (family == "qwen3"),
         "qwen3 needs --qk-layernorm" if family == "qwen3" else "no --qk-layernorm (use qwen3)")
    if family == "qwen2":
        need(cfg.disable_bias_linear and cfg.add_qkv_bias, "needs --disable-bias-linear --add-qkv-bias")
    elif family == "mistral":
        need(cfg.disable_bias_linear and not cfg.add_qkv_bias, "needs --disable-bias-linear and no --add-qkv-bias")
    else:  # llama (attention_bias = mlp_bias) and qwen3 (attention_bias only)
        need(not (cfg.disable_bias_linear and cfg.add_qkv_bias), "q/k/v-only biases need family qwen2")
        need(family == "llama" or cfg.disable_bias_linear, "needs --disable-bias-linear (MLP has no bias)")


def hf_config_from_model_config(cfg: ModelConfig, vocab_size: int, family: str) -> dict:
    """A config.json dict for ``transformers.AutoConfig`` (readable by transformers 4.x and 5.x).

    Token ids (bos/eos/pad) are left unset: add them from your tokenizer. ``torch_dtype`` is float32
    here; save_hf_dir writes the dtype of the saved tensors.
    """
    _check_family(family)
    _check_representable(cfg, family)
    tied = not cfg.untie_embeddings_and_output_weights
    out: dict[str, Any] = {"architectures": [_ARCHITECTURES[family]], "model_type": family,
                           "vocab_size": int(vocab_size), "torch_dtype": "float32", "tie_word_embeddings": tied,
                           "initializer_range": cfg.init_method_std, "use_cache": True,
                           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if family == "gpt2":
        out.update(n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
                   n_inner=cfg.ffn_hidden_size, n_positions=cfg.max_position_embeddings,
                   activation_function="gelu_new" if cfg.openai_gelu else "gelu",
                   layer_norm_epsilon=cfg.norm_epsilon, resid_pdrop=cfg.hidden_dropout,
                   embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
                   scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
        return out
    out.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
               head_dim=cfg.kv_channels, hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
               rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base, attention_dropout=cfg.attention_dropout)
    if cfg.use_rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **_LLAMA3_FIXED}
    if family == "llama":
        out.update(attention_bias=not cfg.disable_bias_linear, mlp_bias=not cfg.disable_bias_linear)
    elif family == "mistral":
        out.update(sliding_window=None)
    elif family == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    elif family == "qwen3":
        out.update(attention_bias=not cfg.disable_bias_linear, use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.num_layers)
    return out


# ----------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------

def _names(names, limit: int = 6) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _normalize_hf_names(hf_state: dict, family: str, tied: bool) -> dict:
    """Accept the variants found in published checkpoints: GPT-2 without the ``transformer.`` prefix
    and with its causal-mask buffers (``attn.bias``/``attn.masked_bias``), old Llama ``rotary_emb.inv_freq``
    buffers, and ``lm_head.weight`` stored next to tied embeddings (transformers ignores it then too)."""
    out = {}
    bare_gpt2 = family == "gpt2" and "transformer.wte.weight" not in hf_state and "wte.weight" in hf_state
    for name, t in hf_state.items():
        if bare_gpt2 and not name.startswith("lm_head."):
            name = "transformer." + name
        if family == "gpt2" and (name.endswith(".attn.bias") or name.endswith(".attn.masked_bias")):
            continue
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        out[name] = t
    return out


def hf_to_paratron(hf_state: dict, cfg: ModelConfig, family: str, padded_vocab_size: int) -> dict:
    """A Hugging Face state dict -> a state dict for ``GPTModel(cfg, padded_vocab_size)`` at TP=1.

    Embedding (and untied output) rows beyond the Hugging Face vocabulary are zeros. Tensors keep
    their dtype and copied ones may share memory with ``hf_state``. For tied models a stored
    ``lm_head.weight`` is ignored, as transformers does. Raises ConversionError naming missing,
    unexpected or mis-shaped tensors.
    """
    rows = name_table(cfg, family)
    hf = _normalize_hf_names(hf_state, family, not cfg.untie_embeddings_and_output_weights)
    wanted = {n for _, names, _ in rows for n in names}
    missing = wanted - hf.keys()
    if missing:
        raise ConversionError(f"{family} state dict is missing {len(missing)} tensor(s): {_names(missing)}")
    extra = hf.keys() - wanted
    if extra:
        raise ConversionError(f"{family} state dict has {len(extra)} tensor(s) this config does not use: "
                              f"{_names(extra)}; the config and the weights do not match")
    vocab_rows = {hf[names[0]].shape[0] for _, names, how in rows if how == "vocab"}
    if len(vocab_rows) != 1:
        raise ConversionError(f"embedding and output layer have different vocabulary sizes {sorted(vocab_rows)}")
    vocab = vocab_rows.pop()
    if vocab > padded_vocab_size:
        raise ConversionError(f"vocabulary of {vocab} rows does not fit padded_vocab_size {padded_vocab_size}")
    shapes = _paratron_shapes(cfg, padded_vocab_size)
    out = {}
    for pname, names, how in rows:
        expect = _hf_shapes(how, shapes[pname], cfg, vocab)
        for n, e in zip(names, expect):
            if tuple(hf[n].shape) != e:
                raise ConversionError(f"shape mismatch for {n}: got {tuple(hf[n].shape)}, the config gives {e}")
        out[pname] = _to_paratron(how, [hf[n] for n in names], cfg, padded_vocab_size).contiguous()
    return out


def paratron_to_hf(state: dict, cfg: ModelConfig, family: str, vocab_size: int) -> dict:
    """A TP=1 paratron state dict -> the full Hugging Face state dict, vocabulary unpadded.

    For tied models ``lm_head.weight`` is left out, as ``save_pretrained`` does (``from_pretrained``
    ties it to the embedding); an ``output_layer.weight`` copy in a tied state dict is ignored.
    """
    rows = name_table(cfg, family)
    if not cfg.untie_embeddings_and_output_weights:
        state = {k: v for k, v in state.items() if k != "output_layer.weight"}
    emb = state.get("embedding.word_embeddings.weight")
    if emb is None:
        raise ConversionError("paratron state dict has no embedding.word_embeddings.weight")
    padded = emb.shape[0]
    if vocab_size > padded:
        raise ConversionError(f"vocab_size {vocab_size} is larger than the embedding's {padded} rows")
    shapes = _paratron_shapes(cfg, padded)
    missing, extra = shapes.keys() - state.keys(), state.keys() - shapes.keys()
    if missing:
        raise ConversionError(f"paratron state dict is missing {len(missing)} tensor(s): {_names(missing)}")
    if extra:
        raise ConversionError(f"paratron state dict has {len(extra)} tensor(s) this config does not use: "
                              f"{_names(extra)}; the config and the weights do not match")
    out = {}
    for pname, names, how in rows:
        if tuple(state[pname].shape) != shapes[pname]:
            raise ConversionError(f"shape mismatch for {pname}: got {tuple(state[pname].shape)}, "
                                  f"the config gives {shapes[pname]}")
        for n, t in zip(names, _to_hf(how, state[pname], cfg, vocab_size)):
            out[n] = t.contiguous()
    return out


# ----------------------------------------------------------------------------------------------
# Directories
# ----------------------------------------------------------------------------------------------

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _standalone(tensors: dict) -> dict:
    """Contiguous CPU tensors that share no storage (safetensors refuses shared or partial storage)."""
    seen, out = set(), {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
            storage = t.untyped_storage()
        seen.add(storage.data_ptr())
        out[name] = t
    return out


def save_hf_dir(path, state: dict, cfg: ModelConfig, family: str, vocab_size: int,
                dtype: Optional[torch.dtype] = None, extra_config: Optional[dict] = None) -> Path:
    """Write a Hugging Face model directory: ``model.safetensors`` and ``config.json``.

    ``dtype`` casts floating-point tensors (default: keep them); ``extra_config`` is merged into
    config.json (e.g. ``{"eos_token_id": 50256}``). Returns the directory.
    """
    from safetensors.torch import save_file

    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = [f for f in _WEIGHT_FILES[1:] if (out_dir / f).exists()]
    if stale:
        raise ConversionError(f"{out_dir} already holds {', '.join(stale)}; save into an empty directory")
    hf = paratron_to_hf(state, cfg, family, vocab_size)
    if dtype is not None:
        hf = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in hf.items()}
    hf = _standalone(hf)
    config = hf_config_from_model_config(cfg, vocab_size, family)
    emb_name = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    config["torch_dtype"] = _dtype_name(hf[emb_name].dtype)
    config.update(extra_config or {})
    save_file(hf, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def load_hf_dir(path) -> tuple[dict, dict]:
    """Read a local Hugging Face model directory -> (state dict, config.json dict). Reads
    model.safetensors, a sharded safetensors index, or pytorch_model.bin (``weights_only=True``)."""
    from safetensors.torch import load_file

    d = Path(path)
    if not d.is_dir():
        raise ConversionError(f"{d} is not a directory; pass a local Hugging Face model directory")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ConversionError(f"{d} has no config.json")
    config = json.loads(cfg_file.read_text())

    def load_bin(f: Path) -> dict:
        return torch.load(f, map_location="cpu", weights_only=True)

    if (d / "model.safetensors").is_file():
        return load_file(str(d / "model.safetensors")), config
    if (d / "pytorch_model.bin").is_file() and not (d / "model.safetensors.index.json").is_file():
        return load_bin(d / "pytorch_model.bin"), config
    for index, loader in (("model.safetensors.index.json", lambda f: load_file(str(f))),
                          ("pytorch_model.bin.index.json", load_bin)):
        if (d / index).is_file():
            weight_map = json.loads((d / index).read_text()).get("weight_map", {})
            state = {}
            for shard in sorted(set(weight_map.values())):
                if not (d / shard).is_file():
                    raise ConversionError(f"{d / index} names shard {shard}, which is not in {d}")
                state.update(loader(d / shard))
            return state, config
    raise ConversionError(f"{d} has no weights: expected one of {', '.join(_WEIGHT_FILES)}")

"""Hugging Face ``config.json`` <-> paratron :class:`~paratron.config.ModelConfig` (GPT-2, Llama,
Mistral, Qwen2, Qwen3, and the mixture-of-experts Mixtral and Qwen3-MoE, whose experts are read and
written by :mod:`paratron.checkpoint.hf_moe`, and DeepSeek-V3: :mod:`paratron.checkpoint.hf_deepseek`).

:func:`model_config_from_hf` turns a Hugging Face config into the ModelConfig that builds the same
network (with the vocabulary size and the family, the ``model_type``), and
:func:`hf_config_from_model_config` writes a config.json that transformers 4.x and 5.x read back as
that network. A setting the other side cannot express (another RoPE type or activation, a bias
layout, a paratron option the family has no key for) is a :class:`ConversionError` naming it rather
than a different model; a sliding window only caps ``seq_length``, up to which paratron's full causal
attention is the same. :func:`padded_vocab_size` is Megatron's vocabulary padding, which decides how
many embedding rows the paratron side has.

The tensors themselves are converted in :mod:`paratron.checkpoint.hf`, which builds on this module
(the families and :class:`ConversionError` live here for both). Configs are plain dicts (or a
``PretrainedConfig``, read through ``to_dict()``); ``transformers`` is never imported.
"""
from __future__ import annotations

import math
from typing import Any

from ..config import ModelConfig
from .families import FAMILIES, HYBRID_FAMILIES, ConversionError
from .hf_deepseek import check_deepseek, deepseek_config, deepseek_hf_config
from .hf_hybrid import ARCHITECTURES as HYBRID_ARCHITECTURES
from .hf_hybrid import check_hybrid_representable, hybrid_hf_config, hybrid_model_config
from .hf_moe import MOE_FAMILIES, REFUSED_MOE, check_moe_representable, hf_moe_config, moe_config_kwargs

__all__ = ["ConversionError", "FAMILIES", "family_of", "model_config_from_hf", "hf_config_from_model_config",
           "padded_vocab_size"]

_ARCHITECTURES = {**HYBRID_ARCHITECTURES, "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                  "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM"}
# The dense family whose attention, norms and biases a mixture-of-experts family has.
_BASE = {"mixtral": "mistral", "qwen3_moe": "qwen3", "qwen2_moe": "qwen2"}
# paratron's Llama-3 rope scaling has these fixed (paratron/model/layers.py: rope_inv_freq).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ConversionError(f"unsupported model family {family!r}; paratron converts {', '.join(FAMILIES)}")


def padded_vocab_size(vocab_size: int, cfg: ModelConfig, tensor_model_parallel_size: int = 1) -> int:
    """Megatron's padding: the next multiple of make_vocab_size_divisible_by x TP."""
    multiple = cfg.make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_floats(value: Any) -> Any:
    """``value`` with transformers' tagged floats ({"__float__": "Infinity"}, how 5.x writes inf and NaN into a
    config.json) turned back into floats, in nested dicts and lists too."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in FLOAT_TAGS:
            return FLOAT_TAGS[value["__float__"]]
        return {k: decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_floats(v) for v in value]
    return value


def _as_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, dict):
        return decode_floats(hf_config)
    if hasattr(hf_config, "to_dict"):  # a transformers PretrainedConfig
        return hf_config.to_dict()
    raise ConversionError(f"expected a config.json dict, got {type(hf_config).__name__}")


def family_of(hf_config: Any) -> str:
    """The family of a Hugging Face config (its ``model_type``)."""
    d = _as_dict(hf_config)
    mt = d.get("model_type")
    if mt is None:
        raise ConversionError("config has no model_type; paratron converts " + ", ".join(FAMILIES))
    if mt in REFUSED_MOE:
        raise ConversionError(f"model_type {mt!r} is not supported: {REFUSED_MOE[mt]}")
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
    if family == "deepseek_v3":
        return deepseek_config(d, _rope_params(d)), vocab, family
    if family in HYBRID_FAMILIES:
        return hybrid_model_config(d, family, _config_need(family)).resolved(), vocab, family
    return _llama_config(d, family), vocab, family


def _config_need(family: str):
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConversionError(f"paratron cannot represent this {family} model: it needs {what}")
    return need


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
    return cfg.resolved()


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

    base = _BASE.get(family, family)
    disable_bias, qkv_bias = _biases(d, family, base)
    n_layers = int(_need(d, "num_hidden_layers"))
    moe = moe_config_kwargs(d, family, n_layers) if family in MOE_FAMILIES else {}
    cfg = ModelConfig(
        num_layers=n_layers, hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=int(_need(d, "intermediate_size")), kv_channels=head_dim,
        group_query_attention=kv_heads != heads, num_query_groups=kv_heads,
        seq_length=_window_capped(d, family, base, positions), max_position_embeddings=positions, position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]), rotary_percent=1.0,
        use_rope_scaling=scaling, rope_scaling_factor=factor,
        normalization="RMSNorm", norm_epsilon=float(d.get("rms_norm_eps", 1e-6)), swiglu=True,
        qk_layernorm=base == "qwen3", disable_bias_linear=disable_bias, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(d.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(d.get("initializer_range", 0.02)), **moe,
    )
    return cfg.resolved()


def _biases(d: dict, family: str, base: str) -> tuple[bool, bool]:
    """(disable_bias_linear, add_qkv_bias) of a Llama-style config; ``base`` its dense family."""
    if base == "qwen2":  # q/k/v biases only (Qwen2-MoE's: its qkv_bias)
        return True, bool(d.get("qkv_bias", True))
    if base in ("llama", "qwen3"):
        attn_bias = bool(d.get("attention_bias", False))
        mlp_bias = bool(d.get("mlp_bias", False)) if base == "llama" else False
        if attn_bias != mlp_bias:
            raise ConversionError(f"{family} with attention_bias={attn_bias} and mlp_bias={mlp_bias} is not "
                                  "supported: paratron has biases on all linear layers or on none (but q/k/v)")
        return not attn_bias, False
    return True, False  # mistral, mixtral


def _window_capped(d: dict, family: str, base: str, positions: int) -> int:
    """The longest sequence full causal attention runs as the model's (sliding-window) attention."""
    window = d["sliding_window"] if "sliding_window" in d else (4096 if family == "mistral" else None)
    uses_window = window is not None and (
        base == "mistral"
        or (base in ("qwen2", "qwen3") and d.get("use_sliding_window", False)
            and "sliding_attention" in (d.get("layer_types") or ["sliding_attention"])))
    return min(positions, int(window)) if uses_window else positions


def check_representable(cfg: ModelConfig, family: str) -> None:
    """Raise when the paratron model has something the Hugging Face family cannot express."""
    cfg = cfg.resolved()

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConversionError(f"{family} cannot represent this model: {what}")

    if family in HYBRID_FAMILIES or cfg.hybrid_layer_pattern is not None or cfg.experimental_attention_variant:
        need(family in HYBRID_FAMILIES, "its layers are transformer layers (this is a hybrid stack: use mamba2, "
             "nemotron_h or qwen3_next)")
        return check_hybrid_representable(cfg, family, need)
    need(cfg.rotary_percent == 1.0 or cfg.position_embedding_type != "rope", "needs --rotary-percent 1.0")
    need(cfg.window_size is None, "no sliding-window attention (--window-size)")
    need(not cfg.rotary_interleaved and cfg.rotary_seq_len_interpolation_factor is None and cfg.no_rope_freq is None,
         "its rotary embedding is rotate-half on every layer (no --rotary-interleaved, "
         "--rotary-seq-len-interpolation-factor or --no-rope-freq)")
    need(cfg.softmax_type == "vanilla", f"no attention sinks (--softmax-type {cfg.softmax_type})")
    need(family == "deepseek_v3" or not cfg.multi_latent_attention, "multi-latent attention needs --family deepseek_v3")
    need(not cfg.mtp_num_layers, "multi-token prediction layers (--mtp-num-layers) have no Hugging Face mapping in "
         "paratron")
    need(cfg.moe_latent_size is None, "MoE latent projections (--moe-latent-size) have no mapping here")
    need(not cfg.use_mup, "muP's attention scale and embedding / logit multipliers (--use-mup) have no keys in its "
         "config")
    for name, what in (("apply_layernorm_1p", "zero-centred norm weights"), ("squared_relu", "the squared-ReLU MLP"),
                       ("quick_geglu", "the quick-GeGLU MLP"), ("attention_output_gate", "the attention output gate")):
        need(not getattr(cfg, name), f"{what} (--{name.replace('_', '-')}) has no tensor mapping here")
    need(cfg.glu_linear_offset == 0.0 and cfg.activation_func_clamp_value is None,
         "GLU offsets and clamps (--glu-linear-offset, --activation-func-clamp-value) have no mapping here")
    if family == "deepseek_v3":
        return check_deepseek(cfg, need)
    check_moe_representable(cfg, family, need)
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
    base = _BASE.get(family, family)
    need(cfg.qk_layernorm == (base == "qwen3"), "needs --qk-layernorm" if base == "qwen3"
         else "no --qk-layernorm (use " + ("qwen3_moe)" if cfg.num_experts else "qwen3)"))
    if family == "qwen2":
        need(cfg.disable_bias_linear and cfg.add_qkv_bias, "needs --disable-bias-linear --add-qkv-bias")
    elif family == "qwen2_moe":
        need(cfg.disable_bias_linear, "needs --disable-bias-linear (with or without --add-qkv-bias)")
    elif base == "mistral":
        need(cfg.disable_bias_linear and not cfg.add_qkv_bias, "needs --disable-bias-linear and no --add-qkv-bias")
    else:  # llama (attention_bias = mlp_bias) and qwen3 (attention_bias only)
        need(not (cfg.disable_bias_linear and cfg.add_qkv_bias), "q/k/v-only biases need family qwen2")
        need(family == "llama" or cfg.disable_bias_linear, "needs --disable-bias-linear (MLP has no bias)")


def hf_config_from_model_config(cfg: ModelConfig, vocab_size: int, family: str) -> dict:
    """A config.json dict for ``transformers.AutoConfig`` (readable by transformers 4.x and 5.x).

    Token ids (bos/eos/pad) are left unset: add them from your tokenizer. ``torch_dtype`` is float32
    here; save_hf_dir writes the dtype of the saved tensors.
    """
    check_family(family)
    cfg = cfg.resolved()  # derived sizes filled (a copy when the caller's is not resolved)
    check_representable(cfg, family)
    tied = not cfg.untie_embeddings_and_output_weights
    out: dict[str, Any] = {"architectures": [_ARCHITECTURES[family]], "model_type": family,
                           "vocab_size": int(vocab_size), "torch_dtype": "float32", "tie_word_embeddings": tied,
                           "initializer_range": cfg.init_method_std, "use_cache": True,
                           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if family in HYBRID_FAMILIES:
        return {**out, **hybrid_hf_config(cfg, family)}
    if family == "gpt2":
        out.update(n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
                   n_inner=cfg.ffn_hidden_size, n_positions=cfg.max_position_embeddings,
                   activation_function="gelu_new" if cfg.openai_gelu else "gelu",
                   layer_norm_epsilon=cfg.norm_epsilon, resid_pdrop=cfg.hidden_dropout,
                   embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
                   scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
        return out
    if family == "deepseek_v3":
        return {**out, **deepseek_hf_config(cfg)}
    out.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
               head_dim=cfg.kv_channels, hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
               rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base, attention_dropout=cfg.attention_dropout)
    if cfg.use_rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **_LLAMA3_FIXED}
    if family == "llama":
        out.update(attention_bias=not cfg.disable_bias_linear, mlp_bias=not cfg.disable_bias_linear)
    elif family in ("mistral", "mixtral"):
        out.update(sliding_window=None)
    elif family in ("qwen2", "qwen2_moe"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
        if family == "qwen2_moe":
            out["qkv_bias"] = cfg.add_qkv_bias
    elif family in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=not cfg.disable_bias_linear, use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.num_layers)
    if family in MOE_FAMILIES:
        out.update(hf_moe_config(cfg, family))
    return out

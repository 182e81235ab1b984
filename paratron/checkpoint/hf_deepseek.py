"""The DeepSeek-V3 side of the Hugging Face conversion (``model_type: deepseek_v3``): multi-latent attention and
its mixture of experts, both ways.

Config. MLA's sizes map one to one (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim`` -> ``--qk-head-dim``,
``qk_rope_head_dim`` -> ``--qk-pos-emb-head-dim``, ``v_head_dim``); DeepSeek always normalises the latents
(``--qk-layernorm``) and lays its rotary dimensions out in interleaved pairs (``rope_interleave: true``, what
paratron's MLA reads; false is refused). RoPE ``default`` is ``--rope-type rope``; ``yarn`` is ``--rope-type yarn``
with ``factor``, ``mscale``, ``mscale_all_dim`` and Megatron's fixed original length 4096 and betas 32 / 1 (other
values refused). Layers from ``first_k_dense_replace`` on are MoE (an explicit ``--moe-layer-freq`` list): sigmoid
scores (``--moe-router-score-function sigmoid``) with the ``e_score_correction_bias`` added for choosing only
(``--moe-router-enable-expert-bias``, the router's ``expert_bias``), the top-k normalised (``norm_topk_prob`` must be
true; false for top-1, which Megatron does not normalise) and scaled by ``routed_scaling_factor``
(``--moe-router-topk-scaling-factor``), ``n_shared_experts`` x ``moe_intermediate_size`` of shared expert, the router
in fp32 as transformers computes it. Group-limited routing (``n_group`` groups, ``topk_group`` kept) ranks groups by
their best two scores in transformers and by their best top-k / topk_group in Megatron: the two agree when top-k /
topk_group is 2 (DeepSeek-V3's 8 / 4), other settings are refused. The router's part is NemotronH's too
(:func:`~paratron.checkpoint.hf_moe.sigmoid_router_kwargs`). Multi-token prediction layers
(``num_nextn_predict_layers``) are not converted.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..config.layer_patterns import parse_moe_layer_freq
from .hf_moe import check_sigmoid_router, sigmoid_router_hf_config, sigmoid_router_kwargs

__all__ = ["deepseek_config", "deepseek_hf_config", "check_deepseek", "deepseek_layer_rows"]

_YARN_FIXED = {"original_max_position_embeddings": 4096.0, "beta_fast": 32.0, "beta_slow": 1.0}


def _error(msg: str) -> Exception:
    from .hf_config import ConversionError
    return ConversionError(msg)


def _rope(d: dict, rope: dict) -> dict:
    if d.get("rope_interleave", True) is not True:
        raise _error("deepseek_v3 rope_interleave false is not supported: paratron's MLA rotates interleaved pairs")
    kind = rope["rope_type"]
    out = dict(rotary_base=float(rope["rope_theta"]), rope_type="rope" if kind == "default" else "yarn")
    if kind == "yarn":
        for key, fixed in _YARN_FIXED.items():
            if float(rope.get(key, fixed)) != fixed:
                raise _error(f"deepseek_v3 yarn {key}={rope[key]} is not supported: paratron's MLA fixes {fixed:g}")
        out.update(rotary_scaling_factor=float(rope["factor"]), mscale=float(rope.get("mscale", 1.0)),
                   mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
    elif kind != "default":
        raise _error(f"deepseek_v3 rope type {kind!r} is not supported (default or yarn)")
    return out


def _moe(d: dict, layers: int) -> dict:
    experts = int(d.get("n_routed_experts") or 0)
    dense = int(d.get("first_k_dense_replace") or 0)
    if not experts or dense >= layers:
        return {}
    shared = int(d.get("n_shared_experts") or 0) * int(d["moe_intermediate_size"])
    return dict(num_experts=experts, moe_ffn_hidden_size=int(d["moe_intermediate_size"]),
                moe_layer_freq="[" + ",".join("0" if i < dense else "1" for i in range(layers)) + "]",
                moe_shared_expert_intermediate_size=shared or None, **sigmoid_router_kwargs(d, "deepseek_v3"))


def deepseek_config(d: dict, rope: dict) -> ModelConfig:
    """The ModelConfig of a DeepSeek-V3 config.json (dict; ``rope``: its RoPE parameters, read by hf_config)."""
    if d.get("attention_bias"):
        raise _error("deepseek_v3 attention_bias true is not supported: paratron's MLA projections have no bias")
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        raise _error(f"deepseek_v3 hidden_act {d['hidden_act']!r} is not supported (paratron's SwiGLU uses silu)")
    layers, positions = int(d["num_hidden_layers"]), int(d.get("max_position_embeddings", 4096))
    return ModelConfig(
        num_layers=layers, hidden_size=int(d["hidden_size"]), num_attention_heads=int(d["num_attention_heads"]),
        ffn_hidden_size=int(d["intermediate_size"]), seq_length=positions, max_position_embeddings=positions,
        position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=float(d.get("rms_norm_eps", 1e-6)),
        swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=not d.get("tie_word_embeddings"),
        hidden_dropout=0.0, attention_dropout=float(d.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(d.get("initializer_range", 0.02)), multi_latent_attention=True, qk_layernorm=True,
        q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=int(d["kv_lora_rank"]), qk_head_dim=int(d["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
        **_rope(d, rope), **_moe(d, layers)).resolved()


def check_deepseek(cfg: ModelConfig, need) -> None:
    """``need(cond, what)`` for every setting of ``cfg`` (resolved) that deepseek_v3 cannot express."""
    need(cfg.multi_latent_attention and cfg.qk_layernorm, "needs --multi-latent-attention with --qk-layernorm")
    need(cfg.normalization == "RMSNorm" and cfg.swiglu and cfg.disable_bias_linear,
         "needs RMSNorm, SwiGLU and --disable-bias-linear")
    if cfg.rope_type == "yarn":
        need(cfg.rotary_percent == 1.0, "needs --rotary-percent 1.0")
    if cfg.num_experts is None:
        return
    pattern = parse_moe_layer_freq(cfg.moe_layer_freq, cfg.num_layers)
    first = pattern.index(1) if 1 in pattern else cfg.num_layers
    need(all(pattern[first:]), "its MoE layers are all the layers from the first MoE one on (--moe-layer-freq)")
    check_sigmoid_router(cfg, need)
    shared = cfg.moe_shared_expert_intermediate_size
    need(not cfg.moe_shared_expert_gate and (shared or 0) % cfg.moe_ffn_hidden_size == 0,
         "an ungated shared expert, a multiple of --moe-ffn-hidden-size wide")


def deepseek_hf_config(cfg: ModelConfig) -> dict:
    """config.json keys of a DeepSeek-V3 model (cfg resolved and representable)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": cfg.rotary_scaling_factor,
                "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim, **_YARN_FIXED}
    out = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
               q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
               qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, hidden_act="silu",
               max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_epsilon,
               rope_parameters=rope, rope_interleave=True, attention_bias=False,
               attention_dropout=cfg.attention_dropout, num_nextn_predict_layers=0)
    if cfg.num_experts is None:
        return {**out, "n_routed_experts": None, "first_k_dense_replace": cfg.num_layers}
    pattern = parse_moe_layer_freq(cfg.moe_layer_freq, cfg.num_layers)
    out.update(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_hidden_size,
               first_k_dense_replace=pattern.index(1),
               n_shared_experts=(cfg.moe_shared_expert_intermediate_size or 0) // cfg.moe_ffn_hidden_size,
               **sigmoid_router_hf_config(cfg))
    return out


def deepseek_layer_rows() -> list:
    """The name-table rows inside ``model.layers.{i}.`` of a DeepSeek-V3 layer besides the norms and the MLPs:
    MLA's projections and norms (q_proj, or the q_a / q_b low-rank pair), the router's expert bias and the shared
    expert."""
    attention = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
                 "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
                 "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}
    rows = [(f"self_attention.{p}.weight", (f"self_attn.{h}.weight",), "copy") for h, p in attention.items()]
    return rows + [
        ("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), "copy"),
        ("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight",
                                                  "mlp.shared_experts.up_proj.weight"), "gate_up"),
        ("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), "copy")]

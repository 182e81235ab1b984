"""Hugging Face <-> paratron for hybrid stacks: ``mamba2`` (Mamba2ForCausalLM: Mamba-2 layers only) and
``nemotron_h`` (NemotronHForCausalLM: Mamba-2, attention, squared-ReLU MLP and MoE layers by its layer types).

Every tensor is a plain copy (or the vocabulary padding): paratron's Mamba-2 in_proj is Hugging Face's
[z | x | B | C | dt], its convolution weight nn.Conv1d's [channels, 1, width], its gated norm grouped the same
way. NemotronH's attention (no rotary embedding) has separate q/k/v projections, fused as Llama's are. Its MoE
layers (E, Nemotron-3 Nano's) are paratron's MoE layer: the sigmoid router with its expert bias, groups and scaling
as DeepSeek-V3's (hf_moe.sigmoid_router_kwargs), squared-ReLU experts without a gate (one up_proj / down_proj per
expert in the files, stacked as paratron's fc1 / fc2), the shared expert that transformers always builds
(``moe_shared_expert_intermediate_size`` wide; ``n_shared_experts`` is not read), and ``moe_latent_size``'s
projections around the routed experts (--moe-latent-size). Not mapped (refused by name): multi-token prediction.

``qwen3_next`` (Qwen3NextForCausalLM): Gated DeltaNet layers, whose per-key-head interleaved in_proj_qkvz /
in_proj_ba are regrouped into paratron's [q | k | v | z | b | a], beside gated attention (q_proj's per-head
[query; gate] rows regrouped by query group), zero-centred norms; MoE layers with the gated shared expert
(hf_moe.py) or dense MLPs.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..config import ModelConfig
from ..config.check_hybrid import mamba_heads
from ..config.layer_patterns import linear_attention_layers, parse_moe_layer_freq
from ..model.mamba import CONV_WIDTH
from .hf_moe import (check_moe_representable, check_sigmoid_router, hf_moe_config, moe_config_kwargs, moe_layer_rows,
                     sigmoid_router_hf_config, sigmoid_router_kwargs)

ARCHITECTURES = {"mamba2": "Mamba2ForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM"}
HYBRID_RESHAPES = ("qkvz_ba", "gated_qkv")  # Qwen3-Next's (the others are hf.py's)
# the names in the files (NemotronH's modules are named model.* in memory, backbone.* on disk: both are read)
PREFIX = {"mamba2": "backbone.", "nemotron_h": "backbone."}
# NemotronH's dt floor: transformers up to 5.18 at least clamped dt at time_step_min, later releases (5.25) at
# time_step_limit[0] (Mamba2's rule). A config is read by the latter (time_step_limit) and written for both
# (time_step_limit [floor, inf] and time_step_min = the floor); time_step_min must be positive (the dt
# initialisation takes its log), so a floor of 0 (Megatron's) is written there as this, which changes dt only where
# softplus' input is below about -20.7.
NO_FLOOR = 1e-9
LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # NemotronH's names
_MAMBA = [("input_layernorm.weight", "norm.weight")] + [
    (f"self_attention.{p}", f"mixer.{h}") for p, h in (
        ("in_proj.weight", "in_proj.weight"), ("conv1d_weight", "conv1d.weight"), ("conv1d_bias", "conv1d.bias"),
        ("dt_bias", "dt_bias"), ("A_log", "A_log"), ("D", "D"), ("norm.weight", "norm.weight"),
        ("out_proj.weight", "out_proj.weight"))]


def _mamba_fields(d: dict, heads: int, head_dim: int, state: str, chunk: int, dt_min: float) -> dict:
    return dict(mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_state_dim=int(d[state]),
                mamba_num_groups=int(d.get("n_groups", 1)), mamba_chunk_size=chunk, mamba_dt_limit_min=dt_min)


def hybrid_model_config(d: dict, family: str, need: Callable) -> ModelConfig:
    """config.json of a hybrid family -> ModelConfig (``need(cond, what)`` raises ConversionError)."""
    if family == "qwen3_next":
        return qwen3_next_model_config(d, need)
    h = int(d["hidden_size"])
    need(int(d.get("conv_kernel", CONV_WIDTH)) == CONV_WIDTH, f"a convolution of {CONV_WIDTH} taps (got "
         f"conv_kernel {d.get('conv_kernel')})")
    need(not d.get("use_bias", False) and d.get("use_conv_bias", True), "in/out projections without biases and a "
         "convolution with one (use_bias false, use_conv_bias true)")
    groups = int(d.get("n_groups", 1))
    common = dict(hidden_size=h, num_attention_heads=groups, kv_channels=max(h // groups, 1),
                  position_embedding_type="none", normalization="RMSNorm",
                  norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
                  disable_bias_linear=True, untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", True),
                  hidden_dropout=0.0, attention_dropout=0.0, init_method_std=float(d.get("initializer_range", 0.02)))
    limit = d.get("time_step_limit") or (0.0, math.inf)
    need(math.isinf(limit[1]), f"no upper dt limit (time_step_limit {list(limit)})")
    if family == "mamba2":
        n = int(d.get("num_hidden_layers", d.get("n_layer", 0)))
        need(d.get("rms_norm", True), "the gated RMSNorm (rms_norm true)")
        return ModelConfig(**common, hybrid_layer_pattern="M" * n, seq_length=4096,
                           **_mamba_fields(d, int(d["num_heads"]), int(d["head_dim"]), "state_size",
                                           int(d.get("chunk_size", 256)), float(limit[0])))
    types = d.get("layers_block_type") or d.get("layer_types")
    symbols = {v: k for k, v in LAYER_TYPES.items()}
    pattern = "".join(symbols.get(t, "?") for t in types)
    need("?" not in pattern, f"layer types {sorted(set(types) - symbols.keys())} are not NemotronH's")
    need(not d.get("num_nextn_predict_layers"), "multi-token prediction layers have no mapping here")
    need(not d.get("attention_bias") and not d.get("mlp_bias"), "attention and MLP without biases")
    act = d.get("mlp_hidden_act", "relu2")
    need(act == "relu2", f"the squared-ReLU MLP (mlp_hidden_act {act})")
    heads = int(d["num_attention_heads"])
    common.update(num_attention_heads=heads, kv_channels=int(d.get("head_dim") or h // heads),
                  group_query_attention=True, num_query_groups=int(d.get("num_key_value_heads") or heads),
                  ffn_hidden_size=int(d["intermediate_size"]), squared_relu=True)
    if "E" in pattern:
        common.update(nemotron_moe_config(d))
    positions = int(d.get("max_position_embeddings", 4096))
    return ModelConfig(**common, hybrid_layer_pattern=pattern, seq_length=positions,
                       **_mamba_fields(d, int(d["mamba_num_heads"]), int(d["mamba_head_dim"]), "ssm_state_size",
                                       int(d.get("chunk_size", 128)), float(limit[0])))


def check_hybrid_representable(cfg: ModelConfig, family: str, need: Callable) -> None:
    """Raise (through ``need``) when the paratron model has something ``family`` cannot express."""
    if family == "qwen3_next":
        return check_qwen3_next(cfg, need)
    pattern = (cfg.hybrid_layer_pattern or "").replace("|", "")
    need(bool(pattern), "needs a hybrid stack (--hybrid-layer-pattern)")
    allowed = "M" if family == "mamba2" else "M*-E"
    need(set(pattern) <= set(allowed), f"its layers are {' '.join(allowed)} only (the pattern is {pattern})")
    need(cfg.normalization == "RMSNorm" and cfg.disable_bias_linear and not cfg.apply_layernorm_1p,
         "needs --normalization RMSNorm and --disable-bias-linear")
    need(cfg.position_embedding_type == "none", "its attention has no position embedding (--position-embedding-type "
         "none)")
    if "-" in pattern or "E" in pattern:
        need(cfg.squared_relu and not cfg.swiglu, "its MLP and experts are squared ReLU (--squared-relu)")
    if "E" in pattern:
        check_nemotron_moe(cfg, need)
    if "*" in pattern:
        need(not (cfg.qk_layernorm or cfg.attention_output_gate or cfg.multi_latent_attention)
             and cfg.softmax_type == "vanilla" and cfg.window_size is None, "plain grouped-query attention")
    need(not cfg.mtp_num_layers and not cfg.use_mup, "no multi-token prediction or muP")
    need(mamba_heads(cfg) * cfg.mamba_head_dim % cfg.hidden_size == 0, "Mamba-2 heads x head dim a multiple of the "
         "hidden size (its config has an integer expand)")


def hybrid_hf_config(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The family's config.json keys for ``cfg`` (beside the common ones hf_config writes)."""
    if family == "qwen3_next":
        return qwen3_next_hf_config(cfg)
    heads = mamba_heads(cfg)
    mamba = dict(n_groups=cfg.mamba_num_groups, conv_kernel=CONV_WIDTH, use_bias=False, use_conv_bias=True,
                 layer_norm_epsilon=cfg.norm_epsilon, chunk_size=cfg.mamba_chunk_size,
                 expand=heads * cfg.mamba_head_dim // cfg.hidden_size, hidden_size=cfg.hidden_size)
    if family == "mamba2":
        return dict(mamba, num_hidden_layers=cfg.num_layers, num_heads=heads, head_dim=cfg.mamba_head_dim,
                    state_size=cfg.mamba_state_dim, rms_norm=True, residual_in_fp32=True,
                    time_step_limit=[cfg.mamba_dt_limit_min, math.inf])
    return dict(mamba, layers_block_type=[LAYER_TYPES[s] for s in cfg.hybrid_layer_pattern.replace("|", "")],
                mamba_num_heads=heads, mamba_head_dim=cfg.mamba_head_dim, ssm_state_size=cfg.mamba_state_dim,
                time_step_min=cfg.mamba_dt_limit_min or NO_FLOOR, time_step_limit=[cfg.mamba_dt_limit_min, math.inf],
                num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels,
                intermediate_size=cfg.ffn_hidden_size, mlp_hidden_act="relu2", attention_bias=False, mlp_bias=False,
                max_position_embeddings=cfg.max_position_embeddings, num_nextn_predict_layers=0,
                **(nemotron_moe_hf_config(cfg) if "E" in cfg.hybrid_layer_pattern else {}))


def hybrid_rows(cfg: ModelConfig, family: str) -> dict[str, tuple[tuple[str, ...], str]]:
    """{paratron name: (Hugging Face names, reshape)} of every tensor of the hybrid model."""
    if family == "qwen3_next":
        from ..model.spec import layer_specs
        return qwen3_next_rows(cfg, layer_specs(cfg))
    pre = PREFIX[family]
    rows = {"embedding.word_embeddings.weight": ((pre + "embeddings.weight",), "vocab"),
            "decoder.final_layernorm.weight": ((pre + "norm_f.weight",), "copy"),
            "output_layer.weight": (("lm_head.weight",), "vocab")}
    for i, s in enumerate(cfg.hybrid_layer_pattern.replace("|", "")):
        hp, pp = f"{pre}layers.{i}.", f"decoder.layers.{i}."
        if s == "M":
            rows.update({pp + p: ((hp + h,), "copy") for p, h in _MAMBA})
        elif s == "*":
            rows[pp + "input_layernorm.weight"] = ((hp + "norm.weight",), "copy")
            rows[pp + "self_attention.linear_qkv.weight"] = (tuple(f"{hp}mixer.{x}_proj.weight" for x in "qkv"), "qkv")
            rows[pp + "self_attention.linear_proj.weight"] = ((hp + "mixer.o_proj.weight",), "copy")
        elif s == "E":
            rows[pp + "pre_mlp_layernorm.weight"] = ((hp + "norm.weight",), "copy")
            rows.update({pp + p: (tuple(hp + n for n in hf), how) for p, hf, how in nemotron_moe_rows(cfg)})
        else:
            rows[pp + "pre_mlp_layernorm.weight"] = ((hp + "norm.weight",), "copy")
            rows[pp + "mlp.linear_fc1.weight"] = ((hp + "mixer.up_proj.weight",), "copy")
            rows[pp + "mlp.linear_fc2.weight"] = ((hp + "mixer.down_proj.weight",), "copy")
    return rows


# ----------------------------------------------------------------------------------------------
# NemotronH's MoE layers (E)
# ----------------------------------------------------------------------------------------------

def nemotron_moe_config(d: dict) -> dict:
    """The ModelConfig fields of NemotronH's MoE layers: ``n_routed_experts`` of ``moe_intermediate_size``, the
    sigmoid router, the shared expert (transformers builds it whatever ``n_shared_experts`` says, of
    ``moe_shared_expert_intermediate_size`` or else ``intermediate_size``), the latent width of the routed experts."""
    experts = d.get("n_routed_experts", d.get("num_local_experts"))
    latent = d.get("moe_latent_size")
    shared = d.get("moe_shared_expert_intermediate_size") or d["intermediate_size"]
    return dict(num_experts=int(experts), moe_ffn_hidden_size=int(d["moe_intermediate_size"]),
                moe_shared_expert_intermediate_size=int(shared), moe_latent_size=int(latent) if latent else None,
                **sigmoid_router_kwargs(d, "nemotron_h"))


def check_nemotron_moe(cfg: ModelConfig, need: Callable) -> None:
    need(cfg.num_experts is not None, "--num-experts for its MoE layers (E)")
    check_sigmoid_router(cfg, need)
    need(cfg.moe_shared_expert_intermediate_size is not None and not cfg.moe_shared_expert_gate,
         "one ungated shared expert in each MoE layer (--moe-shared-expert-intermediate-size without "
         "--moe-shared-expert-gate): transformers always builds it")


def nemotron_moe_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    return dict(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_hidden_size, n_shared_experts=1,
                moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                moe_latent_size=cfg.moe_latent_size, **sigmoid_router_hf_config(cfg))


def nemotron_moe_rows(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """Rows inside a NemotronH layer (``backbone.layers.{i}.``) of its MoE mixer besides the norm: router, experts
    (hf_moe.moe_layer_rows), the router's e_score_correction_bias, the shared expert, the latent projections."""
    rows = moe_layer_rows(cfg, "nemotron_h") + [
        ("mlp.router.expert_bias", ("mixer.gate.e_score_correction_bias",), "copy"),
        ("mlp.shared_experts.linear_fc1.weight", ("mixer.shared_experts.up_proj.weight",), "copy"),
        ("mlp.shared_experts.linear_fc2.weight", ("mixer.shared_experts.down_proj.weight",), "copy")]
    if cfg.moe_latent_size is not None:
        rows += [(f"mlp.{w}.weight", (f"mixer.{w}.weight",), "copy") for w in ("fc1_latent_proj", "fc2_latent_proj")]
    return rows


# ----------------------------------------------------------------------------------------------
# Qwen3-Next: Gated DeltaNet layers beside gated attention, in a GPT stack, with MoE or dense MLPs
# ----------------------------------------------------------------------------------------------

def qwen3_next_model_config(d: dict, need: Callable) -> ModelConfig:
    """Qwen3NextForCausalLM's config.json -> ModelConfig: its MoE layers (router, experts, the gated shared expert;
    hf_moe.py) where ``num_experts`` > 0, except ``mlp_only_layers``; dense SwiGLU MLPs of ``intermediate_size``
    elsewhere."""
    n = int(d["num_hidden_layers"])
    dense = d.get("num_experts", 0) == 0 or set(range(n)) <= set(d.get("mlp_only_layers") or [])
    moe = {} if dense else moe_config_kwargs(d, "qwen3_next", n)
    need(not d.get("attention_bias"), "attention without biases")
    types = d.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    rope = d.get("rope_parameters") or {}
    heads = int(d["num_attention_heads"])
    return ModelConfig(
        num_layers=n, hidden_size=int(d["hidden_size"]), ffn_hidden_size=int(d["intermediate_size"]), swiglu=True,
        num_attention_heads=heads, group_query_attention=True, num_query_groups=int(d["num_key_value_heads"]),
        kv_channels=int(d.get("head_dim") or int(d["hidden_size"]) // heads), qk_layernorm=True,
        attention_output_gate=True, apply_layernorm_1p=True, normalization="RMSNorm",
        norm_epsilon=float(d.get("rms_norm_eps", 1e-6)), position_embedding_type="rope",
        rotary_base=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        rotary_percent=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))),
        seq_length=int(d.get("max_position_embeddings", 4096)), disable_bias_linear=True,
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False), hidden_dropout=0.0,
        attention_dropout=0.0, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=str([int(t == "linear_attention") for t in types]),
        linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(d["linear_key_head_dim"]), linear_value_head_dim=int(d["linear_value_head_dim"]),
        linear_num_key_heads=int(d["linear_num_key_heads"]), linear_num_value_heads=int(d["linear_num_value_heads"]),
        init_method_std=float(d.get("initializer_range", 0.02)), **moe)


def check_qwen3_next(cfg: ModelConfig, need: Callable) -> None:
    need(cfg.experimental_attention_variant is not None and cfg.hybrid_layer_pattern is None,
         "Gated DeltaNet layers by --experimental-attention-variant gated_delta_net")
    need(cfg.swiglu and cfg.normalization == "RMSNorm" and cfg.apply_layernorm_1p and cfg.qk_layernorm
         and cfg.attention_output_gate and cfg.disable_bias_linear and cfg.position_embedding_type == "rope",
         "--swiglu --normalization RMSNorm --apply-layernorm-1p --qk-layernorm --attention-output-gate "
         "--disable-bias-linear --position-embedding-type rope")
    need(not cfg.mtp_num_layers, "no multi-token prediction")
    if cfg.num_experts is not None:
        check_moe_representable(cfg, "qwen3_next", need)


def qwen3_next_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    types = ["linear_attention" if g else "full_attention"
             for g in linear_attention_layers(cfg.linear_attention_freq, cfg.num_layers)]
    return dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
                head_dim=cfg.kv_channels, hidden_act="silu", rms_norm_eps=cfg.norm_epsilon,
                max_position_embeddings=cfg.max_position_embeddings, attention_bias=False, layer_types=types,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base,
                                 "partial_rotary_factor": cfg.rotary_percent},
                linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, linear_key_head_dim=cfg.linear_key_head_dim,
                linear_value_head_dim=cfg.linear_value_head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
                linear_num_value_heads=cfg.linear_num_value_heads,
                **(hf_moe_config(cfg, "qwen3_next") if cfg.num_experts is not None else
                   dict(num_experts=0, mlp_only_layers=list(range(cfg.num_layers)), decoder_sparse_step=1)))


def qwen3_next_rows(cfg: ModelConfig, specs) -> dict[str, tuple[tuple[str, ...], str]]:
    moe = parse_moe_layer_freq(cfg.moe_layer_freq, cfg.num_layers) if cfg.num_experts else [0] * cfg.num_layers
    rows = {"embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "vocab"),
            "decoder.final_layernorm.weight": (("model.norm.weight",), "copy"),
            "output_layer.weight": (("lm_head.weight",), "vocab")}
    for s in specs:
        hp, pp = f"model.layers.{s.index}.", f"decoder.layers.{s.index}."
        rows[pp + "input_layernorm.weight"] = ((hp + "input_layernorm.weight",), "copy")
        rows[pp + "pre_mlp_layernorm.weight"] = ((hp + "post_attention_layernorm.weight",), "copy")
        if moe[s.index]:
            rows.update({pp + p: (tuple(hp + n for n in hf), how) for p, hf, how in moe_layer_rows(cfg, "qwen3_next")})
        else:
            rows[pp + "mlp.linear_fc1.weight"] = ((hp + "mlp.gate_proj.weight", hp + "mlp.up_proj.weight"), "gate_up")
            rows[pp + "mlp.linear_fc2.weight"] = ((hp + "mlp.down_proj.weight",), "copy")
        a, m = pp + "self_attention.", hp + ("linear_attn." if s.mixer == "gdn" else "self_attn.")
        if s.mixer == "gdn":
            rows[a + "in_proj.weight"] = ((m + "in_proj_qkvz.weight", m + "in_proj_ba.weight"), "qkvz_ba")
            rows.update({a + p: ((m + h,), "copy") for p, h in (
                ("conv1d_weight", "conv1d.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"),
                ("out_norm.weight", "norm.weight"), ("out_proj.weight", "out_proj.weight"))})
        else:
            rows[a + "linear_qkv.weight"] = (tuple(m + f"{x}_proj.weight" for x in "qkv"), "gated_qkv")
            rows[a + "linear_proj.weight"] = ((m + "o_proj.weight",), "copy")
            rows[a + "q_layernorm.weight"] = ((m + "q_norm.weight",), "copy")
            rows[a + "k_layernorm.weight"] = ((m + "k_norm.weight",), "copy")
    return rows


def qkvz_ba_to_paratron(qkvz: torch.Tensor, ba: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Qwen3-Next's per-key-head [q_i, k_i, v_i, z_i] and [b_i, a_i] rows -> paratron's [q | k | v | z | b | a]."""
    nk, dk, dv, r = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, \
        cfg.linear_num_value_heads // cfg.linear_num_key_heads
    q, k, v, z = qkvz.reshape(nk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(nk, 2 * r, -1).split([r, r], dim=1)
    return torch.cat([t.reshape(-1, qkvz.shape[-1]) for t in (q, k, v, z, b, a)])


def qkvz_ba_to_hf(w: torch.Tensor, cfg: ModelConfig) -> list:
    nk, dk, dv, r = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, \
        cfg.linear_num_value_heads // cfg.linear_num_key_heads
    q, k, v, z, b, a = (t.reshape(nk, -1, w.shape[-1]) for t in w.split([nk * dk, nk * dk, nk * r * dv,
                                                                          nk * r * dv, nk * r, nk * r]))
    return [torch.cat([q, k, v, z], dim=1).reshape(-1, w.shape[-1]), torch.cat([b, a], dim=1).reshape(-1, w.shape[-1])]


def gated_qkv_to_paratron(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Per-head [query; gate] rows of q_proj, k_proj, v_proj -> paratron's QKV by group: its query heads, their gate
    heads, its key head, its value head."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    qg = qg.reshape(g, per, 2, d, -1)
    parts = [qg[:, :, 0].reshape(g, per * d, -1), qg[:, :, 1].reshape(g, per * d, -1), k.reshape(g, d, -1),
             v.reshape(g, d, -1)]
    return torch.cat(parts, dim=1).reshape(-1, qg.shape[-1])


def gated_qkv_to_hf(w: torch.Tensor, cfg: ModelConfig) -> list:
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    q, gate, k, v = w.reshape(g, -1, w.shape[-1]).split([per * d, per * d, d, d], dim=1)
    qg = torch.stack([q.reshape(g, per, d, -1), gate.reshape(g, per, d, -1)], dim=2)
    return [qg.reshape(-1, w.shape[-1]), k.reshape(-1, w.shape[-1]), v.reshape(-1, w.shape[-1])]


def hybrid_hf_shapes(how: str, pshape: tuple, cfg: ModelConfig) -> list[tuple]:
    h = pshape[-1]
    if how == "qkvz_ba":
        nv = cfg.linear_num_value_heads
        return [(pshape[0] - 2 * nv, h), (2 * nv, h)]
    d, heads, groups = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    return [(2 * heads * d, h), (groups * d, h), (groups * d, h)]

"""Checks of the model section (``resolve_model``: a model config alone, as GPTModel and HF conversion use
it): the shape and Megatron's derived defaults, multi-latent attention, muP, the attention variants
(sliding windows, attention sinks, --rope-type, YaRN), the activation variants and multi-token prediction.
Every problem is one line naming the flag and the fix."""
from __future__ import annotations

import math

from ..errors import ConfigError
from .check_hybrid import validate_hybrid
from .check_moe import validate_moe
from .layer_patterns import parse_window_size, rope_layers, window_layers
from .check_t5 import resolve_encoder_decoder
from .rules import changed_flags, need
from .sections import Config, ModelConfig, flag
from .values import SOFTMAX_TYPES

YARN_FLAGS = {"rotary_scaling_factor": 1.0, "yarn_original_max_position_embeddings": None, "yarn_beta_fast": None,
              "yarn_beta_slow": None, "yarn_correction_range_round_to_int": True, "mscale": 1.0, "mscale_all_dim": 0.0}
MLA_YARN_FLAGS = ("rotary_scaling_factor", "mscale", "mscale_all_dim")  # also read by multi-latent attention
ROPE_TYPES = ("rope", "yarn")
SHAPE_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
DEFAULT_SCALING = ModelConfig.__dataclass_fields__["mtp_loss_scaling_factor"].default


# --enable-gpt-oss: the YaRN values Megatron's post-training builder sets (those of HF's gpt-oss configs)
GPT_OSS_YARN = {"position_embedding_type": "yarn", "rotary_scaling_factor": 32.0,
                "yarn_original_max_position_embeddings": 131072, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": False}


def validate_model(m: ModelConfig) -> None:
    """Checks of the model's shape; fills Megatron's derived defaults."""
    validate_hybrid(m)  # first: a hybrid pattern sets --num-layers
    resolve_encoder_decoder(m)  # T5's --encoder-num-layers / --encoder-seq-length
    if m.enable_gpt_oss:  # as Megatron, the preset replaces whatever YaRN values were given
        for name, value in GPT_OSS_YARN.items():
            setattr(m, name, value)
    need(m.hidden_size % m.num_attention_heads == 0 or m.kv_channels is not None,
         f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}; "
         "change one of them or set --kv-channels")
    need(not m.group_query_attention or m.num_query_groups is not None,
         "--group-query-attention needs --num-query-groups N")
    if m.kv_channels is None:
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if m.ffn_hidden_size is None:
        ffn = int((4 * m.hidden_size * 2 / 3) / 64) * 64 if m.swiglu else 0
        m.ffn_hidden_size = ffn or 4 * m.hidden_size
    if not m.group_query_attention or m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    need(m.num_attention_heads % m.num_query_groups == 0,
         f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups "
         f"{m.num_query_groups}")
    if m.use_rotary_position_embeddings:  # Megatron's older spelling
        m.position_embedding_type = "rope"
    need(not m.no_position_embedding or m.position_embedding_type in ("rope", "yarn", "none"),
         f"--no-position-embedding with --position-embedding-type {m.position_embedding_type}: Megatron accepts it "
         "only with rope; for no position embedding use --position-embedding-type none")
    need(m.position_embedding_type in ("learned_absolute", "rope", "yarn", "none", "relative"),
         "--position-embedding-type must be learned_absolute, rope, yarn, none or relative (T5) (got "
         f"{m.position_embedding_type})")
    need(m.seq_length <= m.max_position_embeddings,  # Megatron's rule, whatever the position embedding
         f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_position_embeddings} (Megatron "
         f"requires max >= seq length for every --position-embedding-type, {m.position_embedding_type} included); "
         "raise --max-position-embeddings")
    need(m.normalization in ("LayerNorm", "RMSNorm"),
         f"--normalization must be LayerNorm or RMSNorm (got {m.normalization})")
    validate_mla(m)
    validate_mup(m)
    validate_moe(m)
    validate_attention_variants(m)
    validate_variants(m)


def validate_mla(m: ModelConfig) -> None:
    """The model's MLA flags; without --multi-latent-attention they must be left unset (else they
    would be silently ignored)."""
    if not m.multi_latent_attention:  # (its YaRN flags: validate_attention_variants, which YaRN on any attention reads)
        given = [f for f in SHAPE_FIELDS if getattr(m, f) != ModelConfig.__dataclass_fields__[f].default]
        need(not given, f"{flag(given[0]) if given else ''} has no effect without --multi-latent-attention; "
             "add it or remove the flag")
        return
    need(not m.group_query_attention, "--multi-latent-attention and --group-query-attention exclude each other "
         "(as in Megatron); remove --group-query-attention")
    need(m.rope_type in (None,) + ROPE_TYPES, f"--rope-type must be rope or yarn (got {m.rope_type})")
    need(m.qk_pos_emb_head_dim % 2 == 0, f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim} must be even (rotary "
         "embedding rotates pairs)")
    need(m.rotary_percent == 1.0 or m.rope_type == "rope", f"--rotary-percent {m.rotary_percent} applies to "
         "multi-latent attention's --rope-type rope only (YaRN rotates the whole rotary part, as Megatron's); add "
         "--rope-type rope or remove the flag")
    need(not m.use_rope_scaling, "--use-rope-scaling (Llama-3.1 scaling) does not apply to multi-latent attention, "
         "whose rotary embedding is --rope-type rope|yarn; remove --use-rope-scaling")

    need(m.window_size is None and m.softmax_type == "vanilla", "sliding-window attention and attention sinks "
         "(--window-size, --softmax-type) are built for the fused-QKV attention only, not for "
         "--multi-latent-attention; remove them")


def validate_mup(m: ModelConfig) -> None:
    """--mup-* only with --use-mup; a given --mup-width-mult must be --hidden-size / --mup-base-hidden-size
    (Megatron computes it); not with multi-latent attention (its softmax scale is YaRN's mscale)."""
    if not m.use_mup:
        given = changed_flags(m, prefix="mup_")
        need(not given, f"{', '.join(given)}: no effect without --use-mup; add it or remove them")
        return
    base = m.mup_base_hidden_size or m.hidden_size
    need(m.mup_width_mult in (1.0, m.hidden_size / base), f"--mup-width-mult {m.mup_width_mult} is computed as "
         f"--hidden-size / --mup-base-hidden-size = {m.hidden_size / base:g}; remove it or give the base size instead")
    need(not m.multi_latent_attention, "--use-mup with --multi-latent-attention: MLA's softmax scale (YaRN's "
         "mscale) under muP is not implemented; remove one of them")
    resolve_mup(m)


def resolve_mup(cfg) -> None:
    """Megatron's derived values, set on the (unfrozen) model section: m from the base width, and the
    output multiplier 1/m when it was left at 1.0. Idempotent (a resolved section resolves to itself)."""
    if not cfg.use_mup:
        return
    base = cfg.mup_base_hidden_size or cfg.hidden_size
    cfg.mup_base_hidden_size = base
    cfg.mup_width_mult = cfg.hidden_size / base
    if cfg.mup_output_mult == 1.0 and cfg.mup_width_mult != 1.0:
        cfg.mup_output_mult = 1.0 / cfg.mup_width_mult


def validate_attention_variants(m) -> None:
    """The model-only checks (the window pattern is parsed here, so a bad one fails at resolve)."""
    need(m.softmax_type in SOFTMAX_TYPES,
         f"--softmax-type {m.softmax_type}: choose one of {', '.join(SOFTMAX_TYPES)}")
    need(m.window_attn_skip_freq is None or m.window_size is not None,
         "--window-attn-skip-freq has no effect without --window-size; set --window-size LEFT,RIGHT or remove it")
    window_layers(m.window_size, m.window_attn_skip_freq, m.num_layers)  # raises on a bad value
    parse_window_size(m.window_size)
    mla = bool(getattr(m, "multi_latent_attention", False))
    validate_rope_options(m, mla)
    need(m.rope_type in (None, "rope", "yarn"), f"--rope-type {m.rope_type}: choose rope or yarn")
    need(mla or m.rope_type != "yarn", "--rope-type yarn is for multi-latent attention (Megatron asserts "
         "rope for standard attention); use --position-embedding-type yarn for YaRN")
    if m.position_embedding_type != "yarn":  # the one check of YaRN flags given without a YaRN to read them
        given = [k for k, default in YARN_FLAGS.items() if getattr(m, k) != default]
        own = [k for k in given if k not in MLA_YARN_FLAGS]  # multi-latent attention's YaRN does not read these
        need(not own, f"{flag(own[0]) if own else ''} has no effect without --position-embedding-type yarn; set "
             "it or remove the flag")
        shared = [k for k in given if k in MLA_YARN_FLAGS and not mla]
        need(not shared, f"{flag(shared[0]) if shared else ''} has no effect without --multi-latent-attention or "
             "--position-embedding-type yarn; set one or remove the flag")
        return
    need(m.rotary_percent == 1.0, "--rotary-percent with --position-embedding-type yarn: Megatron's YaRN rotates "
         "the whole head (it ignores --rotary-percent); remove --rotary-percent")
    need(not m.use_rope_scaling, "--use-rope-scaling (Llama-3.1 scaling) and --position-embedding-type yarn exclude "
         "each other; choose one")
    need(m.rotary_scaling_factor > 0, f"--rotary-scaling-factor must be > 0 (got {m.rotary_scaling_factor})")
    for name in ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow"):
        value = getattr(m, name)
        need(value is None or value > 0, f"{flag(name)} must be > 0 (got {value})")


def validate_rope_options(m, mla: bool) -> None:
    """--rotary-interleaved, --rotary-seq-len-interpolation-factor and --no-rope-freq: rotary embeddings
    of standard attention (MLA rotates its own part, interleaved already)."""
    factor = m.rotary_seq_len_interpolation_factor
    given = [flag for flag, on in (("--rotary-interleaved", m.rotary_interleaved),
                                   ("--rotary-seq-len-interpolation-factor", factor is not None),
                                   ("--no-rope-freq", m.no_rope_freq is not None)) if on]
    if not given:
        return
    need(not mla, f"{given[0]} with --multi-latent-attention: MLA rotates its own rotary part (in interleaved "
         "pairs already); remove the flag")
    need(m.position_embedding_type in ("rope", "yarn"), f"{given[0]} has no effect without rotary embeddings; add "
         "--position-embedding-type rope or remove the flag")
    need(factor is None or m.position_embedding_type == "rope", "--rotary-seq-len-interpolation-factor with "
         "--position-embedding-type yarn: YaRN scales positions its own way; remove one")  # (> 0: ranges.py)
    rope_layers(m.no_rope_freq, m.num_layers)  # raises on a bad value


def validate_variants(m: ModelConfig) -> None:
    """--squared-relu / --quick-geglu / --swiglu, the GLU offset and clamp, as Megatron checks them."""
    acts = [name for name in ("swiglu", "squared_relu", "quick_geglu", "geglu") if getattr(m, name)]
    if len(acts) > 1:
        raise ConfigError(f"{flag(acts[0])} and {flag(acts[1])} exclude each other; choose one activation")
    gated = m.swiglu or m.quick_geglu or m.geglu
    if m.glu_linear_offset != 0.0:
        need(gated, "--glu-linear-offset needs a gated MLP (--quick-geglu or --swiglu)")
        need(not m.swiglu or m.no_bias_swiglu_fusion, "--glu-linear-offset with --swiglu: Megatron's fused SwiGLU "
             "has no offset; use --quick-geglu or add --no-bias-swiglu-fusion")
    clamp = m.activation_func_clamp_value
    if clamp is not None:
        need(gated, "--activation-func-clamp-value needs a gated MLP (--quick-geglu or --swiglu)")
        need(math.isfinite(clamp) and clamp > 0, f"--activation-func-clamp-value must be finite and > 0 (got {clamp})")
        if m.swiglu:
            need(m.num_experts is not None, "--activation-func-clamp-value with --swiglu needs --num-experts "
                 "(Megatron clamps SwiGLU only in MoE models)")
            need(m.glu_linear_offset == 0.0, "--activation-func-clamp-value with --swiglu needs --glu-linear-offset 0")


def validate_mtp(cfg: Config) -> None:
    """--mtp-num-layers and --mtp-loss-scaling-factor, and the parallel layouts MTP runs under."""
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers is None:
        need(m.mtp_loss_scaling_factor == DEFAULT_SCALING, "--mtp-loss-scaling-factor has no effect without "
             "--mtp-num-layers; set --mtp-num-layers or remove the flag")
        for name in ("mtp_use_repeated_layer", "mtp_detach_heads"):
            need(not getattr(m, name), f"--{name.replace('_', '-')} has no effect without --mtp-num-layers; set "
                 "--mtp-num-layers or remove the flag")
        return
    need(p.pipeline_model_parallel_size == 1, "--mtp-num-layers with --pipeline-model-parallel-size "
         f"{p.pipeline_model_parallel_size}: multi-token prediction runs without pipeline parallelism only in "
         "paratron; use --pipeline-model-parallel-size 1")

"""Checks of the attention variants: sliding windows (--window-size, --window-attn-skip-freq), the
softmax type (attention sinks), --rope-type and YaRN's flags (--position-embedding-type yarn).
Called from validate.py's resolve steps; every problem is one line naming the flag and the fix."""
from __future__ import annotations

from ..errors import ConfigError

YARN_FLAGS = {"rotary_scaling_factor": 1.0, "yarn_original_max_position_embeddings": None, "yarn_beta_fast": None,
              "yarn_beta_slow": None, "yarn_correction_range_round_to_int": True, "mscale": 1.0, "mscale_all_dim": 0.0}
MLA_YARN_FLAGS = ("rotary_scaling_factor", "mscale", "mscale_all_dim")  # also read by multi-latent attention


def need(cond, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_attention_variants(m) -> None:
    """The model-only checks (the window pattern is parsed here, so a bad one fails at resolve)."""
    from ..model.core_attention import SOFTMAX_TYPES, parse_window_size, window_layers
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
        need(not own, f"{_flag(own[0]) if own else ''} has no effect without --position-embedding-type yarn; set "
             "it or remove the flag")
        shared = [k for k in given if k in MLA_YARN_FLAGS and not mla]
        need(not shared, f"{_flag(shared[0]) if shared else ''} has no effect without --multi-latent-attention or "
             "--position-embedding-type yarn; set one or remove the flag")
        return
    need(m.rotary_percent == 1.0, "--rotary-percent with --position-embedding-type yarn: Megatron's YaRN rotates "
         "the whole head (it ignores --rotary-percent); remove --rotary-percent")
    need(not m.use_rope_scaling, "--use-rope-scaling (Llama-3.1 scaling) and --position-embedding-type yarn exclude "
         "each other; choose one")
    need(m.rotary_scaling_factor > 0, f"--rotary-scaling-factor must be > 0 (got {m.rotary_scaling_factor})")
    for name in ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow"):
        value = getattr(m, name)
        need(value is None or value > 0, f"{_flag(name)} must be > 0 (got {value})")


def validate_rope_options(m, mla: bool) -> None:
    """--rotary-interleaved, --rotary-seq-len-interpolation-factor and --no-rope-freq: rotary embeddings
    of standard attention (MLA rotates its own part, interleaved already)."""
    from ..model.core_attention import rope_layers
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

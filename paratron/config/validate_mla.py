"""Checks of multi-latent attention's flags (paratron/model/mla.py), called from validate.py."""
from __future__ import annotations

from .sections import ModelConfig, flag

ROPE_TYPES = ("rope", "yarn")
SHAPE_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def validate_mla(m: ModelConfig, need) -> None:
    """The model's MLA flags; without --multi-latent-attention they must be left unset (else they
    would be silently ignored)."""
    if not m.multi_latent_attention:  # (its YaRN flags: validate_attnvar, which YaRN on any attention reads)
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

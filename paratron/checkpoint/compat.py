"""Is a checkpoint a checkpoint of this model? Its ``common.json`` holds the whole configuration of
the run that saved it; :func:`check_model_config` compares every field that changes what the
model computes with this run's, before any tensor is read.

Tensor shapes alone are not enough: fewer ``--num-layers`` would drop the later layers, other
``--num-attention-heads`` with the same hidden size re-read QKV as other heads, another vocabulary
within the same padding keeps the table's shape, rope over a learned-position checkpoint ignores
its position table, RMSNorm over LayerNorm drops the norms' biases: all would load without a word.
Any difference is one error naming every differing field with both values; with
``--override-checkpoint-model-args`` the command line's values win on purpose (a warning lists the
differences; tensors must still have the shapes this model needs). Fields that do not change the
function (dropout, initialisation, fusions, sequence length within the positions) are not compared.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from ..config import Config, flag
from .pieces import CheckpointError

# The model fields compared always; the group-query flag is folded into --num-query-groups (resolved).
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "position_embedding_type", "normalization", "norm_epsilon", "swiglu", "openai_gelu",
                "qk_layernorm", "disable_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
                "num_experts")
LEARNED_FIELDS = ("max_position_embeddings",)  # the learned position table's size
ROPE_FIELDS = ("rotary_base", "rotary_percent", "use_rope_scaling", "rotary_interleaved", "no_rope_freq")
ROPE_SCALING_FIELDS = ("rope_scaling_factor",)
MOE_FIELDS = ("moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_score_function",
              "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
              "moe_shared_expert_intermediate_size")
ATTENTION_FIELDS = ("window_size", "window_attn_skip_freq", "softmax_type")  # absent from older checkpoints
YARN_FIELDS = ("rotary_base", "rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim")
MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "rotary_base")
DATA_FIELDS = ("vocab_size",)  # the tokenizer's vocabulary (the padding may change with TP: resharding)


def _compared(saved: dict, now: dict) -> list[str]:
    """The model fields that matter for this pair of configurations."""
    names = list(MODEL_FIELDS) + list(ATTENTION_FIELDS)
    kinds = {saved.get("position_embedding_type"), now.get("position_embedding_type")}
    if kinds == {"learned_absolute"}:
        names += LEARNED_FIELDS
    if "rope" in kinds:
        names += ROPE_FIELDS
        if saved.get("use_rope_scaling") or now.get("use_rope_scaling"):
            names += ROPE_SCALING_FIELDS
    if kinds == {"yarn"}:
        names += YARN_FIELDS
    if saved.get("num_experts") is not None or now.get("num_experts") is not None:
        names += MOE_FIELDS
    if saved.get("multi_latent_attention") or now.get("multi_latent_attention"):
        names += [n for n in MLA_FIELDS if n not in names]
    if now.get("model") == "bert":  # the binary head's tensors
        names += ["bert_no_binary_head"]
    if saved.get("mtp_num_layers") or now.get("mtp_num_layers"):  # the MTP layers' tensors
        names.append("mtp_num_layers")
    return names


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_differences(saved: dict, cfg: Config, vocab: bool = True) -> list[tuple[str, object, object]]:
    """(field, checkpoint's value, this run's value) of each model-function field that differs;
    ``saved`` is the checkpoint's ``Config.to_dict()``; ``vocab``: compare the vocabulary size too."""
    now = cfg.to_dict()
    out = []
    for section, names in (("model", _compared(saved.get("model", {}), now["model"])),
                           ("data", DATA_FIELDS if vocab else ())):
        old, new = saved.get(section, {}), now[section]
        for name in names:
            if name in old and old[name] != new[name]:
                out.append((name, old[name], new[name]))
    return out


def check_model_config(common: dict, cfg: Config, where: Path, warn: Callable[[str], None]) -> None:
    """Raise CheckpointError naming every differing field (checkpoint value vs this run's) unless
    ``--override-checkpoint-model-args``, which warns instead. ``common``: the checkpoint's
    common.json. A checkpoint without a saved config is not checked; one converted from Hugging Face
    holds the embedding's row count, not a tokenizer's vocabulary, so its vocabulary is not compared."""
    saved: Optional[dict] = common.get("config")
    if not saved:
        return
    family = saved.get("model", {}).get("model", "gpt")  # (checkpoints before --model hold GPT models)
    if family != cfg.model.model:
        raise CheckpointError(f"{where} holds a {family.upper()} model (--model {family}) but this run builds "
                              f"{cfg.model.model.upper()} (--model {cfg.model.model}); load a "
                              f"{cfg.model.model.upper()} checkpoint or train from scratch")
    diffs = model_differences(saved, cfg, vocab="converted_from" not in common)
    if not diffs:
        return
    listed = ", ".join(f"{flag(n)} {_show(old)} in the checkpoint vs {_show(new)} here" for n, old, new in diffs)
    if cfg.ckpt.override_checkpoint_model_args:
        warn(f" WARNING: {where} was saved by another model ({listed}); loading it anyway "
             "(--override-checkpoint-model-args)")
        return
    raise CheckpointError(f"{where} was saved by another model: {listed}; pass the checkpoint's values, or "
                          "--override-checkpoint-model-args to load it on purpose (its tensors must still fit)")

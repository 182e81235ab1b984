"""The range of every numeric flag, in one table, checked before anything else of a config.

``resolve()`` (and ``ModelConfig.resolved()``) run :func:`check_ranges` first, on the values from
the command line, YAML files and presets alike, so a number out of range is one line,
``--FLAG must be RANGE (got X)``, before any model, group or file is built. A field of type ``int``
must hold an integer (YAML's ``train_iters: 2.5`` is refused, not truncated). Every ``int`` and
``float`` field of the config has an entry (tests/unit/test_config_ranges.py checks it), so a new
numeric flag cannot skip the check. ``None`` (a flag left unset) is always allowed.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..errors import ConfigError
from .sections import FIELD_TYPES, base_type, flag


@dataclasses.dataclass(frozen=True)
class Range:
    """``low``/``high`` bounds (None: unbounded), each inclusive or not; ``text`` is the message's wording."""
    text: str
    low: Optional[float] = None
    low_inclusive: bool = True
    high: Optional[float] = None
    high_inclusive: bool = False
    finite: bool = False  # infinities refused too (bounded ranges refuse them already)

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and (math.isnan(value) or (self.finite and math.isinf(value))):
            return False
        if self.low is not None and (value < self.low or (value == self.low and not self.low_inclusive)):
            return False
        return self.high is None or value < self.high or (value == self.high and self.high_inclusive)


AT_LEAST_0 = Range(">= 0", 0)
AT_LEAST_1 = Range(">= 1", 1)
POSITIVE = Range("> 0", 0, low_inclusive=False)
FRACTION = Range("in [0, 1)", 0, True, 1, False)  # dropout, Adam betas
FRACTION_OPEN_LOW = Range("in (0, 1]", 0, False, 1, True)  # --rotary-percent
FRACTION_CLOSED = Range("in [0, 1]", 0, True, 1, True)  # --lr-warmup-fraction
AT_LEAST_3 = Range(">= 3", 3)  # --tiktoken-num-special-tokens (unk, bos, eos)
ABOVE_1 = Range("> 1", 1, low_inclusive=False)  # --spiky-loss-factor (a factor of the running max)
FINITE = Range("a finite number", finite=True)  # --glu-linear-offset (any sign)

RANGES: dict[str, Range] = {
    # issue-19 variants: YaRN, routing groups, GLU offsets/clamps, pipeline stages, decoupled LR, Muon, retention
    "yarn_original_max_position_embeddings": AT_LEAST_1, "yarn_beta_fast": POSITIVE, "yarn_beta_slow": POSITIVE,
    "moe_router_num_groups": AT_LEAST_1, "moe_router_group_topk": AT_LEAST_1, "glu_linear_offset": FINITE,
    "activation_func_clamp_value": POSITIVE, "num_virtual_stages_per_pipeline_rank": AT_LEAST_1,
    "decoupled_lr": AT_LEAST_0, "decoupled_min_lr": AT_LEAST_0, "muon_momentum": FRACTION,
    "muon_num_ns_steps": AT_LEAST_1, "muon_extra_scale_factor": POSITIVE, "save_retain_interval": AT_LEAST_1,
    "rotary_seq_len_interpolation_factor": POSITIVE, "local_rank": AT_LEAST_0, "padded_vocab_size": AT_LEAST_1,
    "check_weight_hash_across_dp_replicas_interval": AT_LEAST_1, "num_layers_at_start_in_bf16": AT_LEAST_0,
    "num_layers_at_end_in_bf16": AT_LEAST_0, "eval_global_batch_size": AT_LEAST_1, "cpu_threads": AT_LEAST_1,
    # encoder-decoder (T5) and BERT data
    "encoder_num_layers": AT_LEAST_1, "decoder_num_layers": AT_LEAST_1, "encoder_seq_length": AT_LEAST_1,
    "decoder_seq_length": AT_LEAST_1, "relative_attention_num_buckets": AT_LEAST_1,
    "relative_attention_max_distance": AT_LEAST_1, "softmax_scale": POSITIVE,
    "mask_prob": Range("in (0, 1)", 0, False, 1, False), "short_seq_prob": FRACTION_CLOSED,
    # hybrid stacks (Mamba-2, Gated DeltaNet)
    "hybrid_attention_ratio": FRACTION_CLOSED, "hybrid_mlp_ratio": FRACTION_CLOSED, "mamba_state_dim": AT_LEAST_1,
    "mamba_head_dim": AT_LEAST_1, "mamba_num_groups": AT_LEAST_1, "mamba_num_heads": AT_LEAST_1,
    "mamba_dt_limit_min": AT_LEAST_0, "mamba_chunk_size": AT_LEAST_1, "linear_conv_kernel_dim": AT_LEAST_1,
    "linear_key_head_dim": AT_LEAST_1, "linear_value_head_dim": AT_LEAST_1, "linear_num_key_heads": AT_LEAST_1,
    "linear_num_value_heads": AT_LEAST_1,
    # sharded optimizer
    "optimizer_offload_fraction": FRACTION_CLOSED,
    "activation_offload_fraction": FRACTION_CLOSED, "min_offloaded_tensor_size": AT_LEAST_0,
    "delta_offload_bytes_across_pp_ranks": AT_LEAST_0, "cuda_graph_warmup_steps": AT_LEAST_1,
    # model
    "num_layers": AT_LEAST_1, "hidden_size": AT_LEAST_1, "ffn_hidden_size": AT_LEAST_1,
    "num_attention_heads": AT_LEAST_1, "kv_channels": AT_LEAST_1, "num_query_groups": AT_LEAST_1,
    "seq_length": AT_LEAST_1, "max_position_embeddings": AT_LEAST_1, "rotary_base": POSITIVE,
    "rotary_percent": FRACTION_OPEN_LOW, "rope_scaling_factor": POSITIVE, "norm_epsilon": POSITIVE,
    "hidden_dropout": FRACTION, "attention_dropout": FRACTION, "init_method_std": POSITIVE,
    "embedding_init_method_std": POSITIVE, "mup_base_hidden_size": AT_LEAST_1, "mup_width_mult": POSITIVE,
    "mup_embedding_mult": POSITIVE, "mup_output_mult": POSITIVE, "mup_base_head_dim": POSITIVE,
    "mup_attn_scale_power": FINITE,
    "make_vocab_size_divisible_by": AT_LEAST_1, "num_experts": AT_LEAST_1, "moe_router_topk": AT_LEAST_1,
    "moe_ffn_hidden_size": AT_LEAST_1, "moe_latent_size": AT_LEAST_1, "moe_aux_loss_coeff": AT_LEAST_0, "moe_z_loss_coeff": AT_LEAST_0,
    "moe_input_jitter_eps": FRACTION,
    "moe_router_topk_scaling_factor": POSITIVE, "moe_router_bias_update_rate": AT_LEAST_0,
    "moe_expert_capacity_factor": POSITIVE, "moe_shared_expert_intermediate_size": AT_LEAST_1,
    "q_lora_rank": AT_LEAST_1, "kv_lora_rank": AT_LEAST_1, "qk_head_dim": AT_LEAST_1, "qk_pos_emb_head_dim": AT_LEAST_1,
    "v_head_dim": AT_LEAST_1, "rotary_scaling_factor": POSITIVE, "mscale": AT_LEAST_0, "mscale_all_dim": AT_LEAST_0,
    "mtp_num_layers": AT_LEAST_1, "mtp_loss_scaling_factor": FINITE,  # any finite weight, as Megatron
    # parallel
    "tensor_model_parallel_size": AT_LEAST_1, "pipeline_model_parallel_size": AT_LEAST_1,
    "virtual_pipeline_model_parallel_size": AT_LEAST_1, "num_layers_per_virtual_pipeline_stage": AT_LEAST_1,
    "microbatch_group_size_per_virtual_pipeline_stage": AT_LEAST_1,
    "decoder_first_pipeline_num_layers": AT_LEAST_0, "decoder_last_pipeline_num_layers": AT_LEAST_0,
    "context_parallel_size": AT_LEAST_1, "expert_model_parallel_size": AT_LEAST_1,
    "expert_tensor_parallel_size": AT_LEAST_1, "ddp_bucket_size": AT_LEAST_1, "ddp_num_buckets": AT_LEAST_1,
    "distributed_timeout_minutes": POSITIVE,
    # train
    "micro_batch_size": AT_LEAST_1, "global_batch_size": AT_LEAST_1, "train_iters": AT_LEAST_0,
    "train_samples": AT_LEAST_0, "eval_interval": AT_LEAST_1, "eval_iters": AT_LEAST_0, "exit_interval": AT_LEAST_1,
    "exit_duration_in_mins": POSITIVE, "seed": AT_LEAST_0, "loss_scale": POSITIVE, "initial_loss_scale": POSITIVE,
    "min_loss_scale": POSITIVE, "loss_scale_window": AT_LEAST_1, "hysteresis": AT_LEAST_1,
    "recompute_num_layers": AT_LEAST_1, "fp8_amax_history_len": AT_LEAST_1, "fp8_margin": AT_LEAST_0,
    "spiky_loss_factor": ABOVE_1, "manual_gc_interval": AT_LEAST_0, "empty_unused_memory_level": AT_LEAST_0,
    # optim
    "lr": AT_LEAST_0, "min_lr": AT_LEAST_0, "lr_decay_iters": AT_LEAST_0, "lr_decay_samples": AT_LEAST_0,
    "lr_warmup_iters": AT_LEAST_0, "lr_warmup_fraction": FRACTION_CLOSED, "lr_warmup_samples": AT_LEAST_0,
    "lr_warmup_init": AT_LEAST_0, "lr_wsd_decay_iters": AT_LEAST_0, "lr_wsd_decay_samples": AT_LEAST_0,
    "weight_decay": AT_LEAST_0, "adam_beta1": FRACTION, "adam_beta2": FRACTION, "adam_eps": POSITIVE,
    "clip_grad": AT_LEAST_0,
    # data
    "num_workers": AT_LEAST_0, "vocab_size": AT_LEAST_1, "null_tokenizer_eod_id": AT_LEAST_0,
    "fim_rate": FRACTION_CLOSED, "fim_spm_rate": FRACTION_CLOSED, "fim_fragment_rate": FRACTION_CLOSED,
    "vocab_extra_ids": AT_LEAST_0, "tiktoken_num_special_tokens": AT_LEAST_3,
    # log
    "log_interval": AT_LEAST_1, "profile_step_start": AT_LEAST_0, "profile_step_end": AT_LEAST_0,
    "log_memory_interval": AT_LEAST_1, "train_sync_interval": AT_LEAST_1, "start_eval_at_iter": AT_LEAST_0, "straggler_minmax_count": AT_LEAST_1,
    "straggler_ctrlr_port": AT_LEAST_1,
    "tensorboard_log_interval": AT_LEAST_1, "tensorboard_queue_size": AT_LEAST_1, "timing_log_level": AT_LEAST_0,
    "logging_level": AT_LEAST_0,
    # ckpt
    "save_interval": AT_LEAST_0, "ckpt_step": AT_LEAST_0, "ckpt_keep_last": AT_LEAST_0,
}


def numeric_fields() -> list[str]:
    """Every config field of type int or float (Optional or not)."""
    return [name for name, tp in FIELD_TYPES.items() if base_type(tp) in (int, float)]


def range_problem(name: str, value) -> Optional[str]:
    """The one-line error for ``value`` of field ``name``, or None when it is in range (None is)."""
    if value is None:
        return None
    tp = base_type(FIELD_TYPES[name])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{flag(name)} must be a number (got {value!r})"
    if tp is int and not isinstance(value, int):
        return f"{flag(name)} must be an integer (got {value!r})"
    rule = RANGES[name]
    if not rule.holds(value):
        return f"{flag(name)} must be {rule.text} (got {value!r})"
    return None


def check_ranges(section) -> None:
    """Raise ConfigError for the first numeric field of ``section`` out of its range."""
    for f in dataclasses.fields(section):
        if f.name in RANGES:
            problem = range_problem(f.name, getattr(section, f.name))
            if problem:
                raise ConfigError(problem)

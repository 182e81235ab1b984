"""Megatron Core's ``TransformerConfig`` (its field names and defaults) mapped onto paratron's ModelConfig.

Three kinds of field:

* mapped: they shape the model and become ModelConfig fields (``layernorm_epsilon`` -> ``norm_epsilon``,
  ``add_bias_linear=False`` -> ``disable_bias_linear``, ``gated_linear_unit`` + ``activation_func`` ->
  ``swiglu`` / ``quick_geglu`` ..., ``num_moe_experts`` -> ``num_experts``, the rest by the same name);
  recomputation, ``sequence_parallel`` and ``params_dtype`` go to paratron's GPTModel arguments;
* kernels: ``attention_backend`` (Megatron's AttnBackend or its name) and ``deterministic_mode`` choose
  paratron's kernel switches (``kernel_config(device, dtype)``: --attention-backend, and under
  deterministic mode SDPA attention and torch's GEMMs, as a training run's --deterministic-mode does);
* accepted: harmless here (fusions, communication overlap, parallel sizes, which come from
  ``parallel_state``, initialisation on CPU, callbacks); kept, changing nothing;
* unsupported: given another value than Megatron's default, a ConfigError names the field.

Any other name is a TypeError, as for any dataclass. ``model_config(...)`` gives the resolved ModelConfig.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ...config import Config, ConfigError, ModelConfig, TrainConfig
from ...config.check_offload import validate_activation_offload
from ...config.check_train import validate_recompute
from ...config.kernels import CHOICES, KernelConfig
from ...kernels import switches

SAME_NAME = (  # Megatron's field = paratron's ModelConfig field
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels", "hidden_dropout",
    "attention_dropout", "add_qkv_bias", "glu_linear_offset", "activation_func_clamp_value", "rotary_interleaved",
    "normalization", "qk_layernorm", "attention_output_gate", "softmax_type", "multi_latent_attention",
    "init_method_std", "embedding_init_method_std", "use_mup", "mup_width_mult", "mup_base_hidden_size",
    "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim", "mup_attn_scale_power", "mtp_num_layers",
    "mtp_loss_scaling_factor", "mtp_use_repeated_layer", "mtp_detach_heads", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate", "moe_expert_capacity_factor", "moe_token_dispatcher_type", "moe_grouped_gemm",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap", "moe_shared_expert_gate",
    "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad",
    "moe_router_num_groups", "moe_router_group_topk", "moe_input_jitter_eps", "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity", "moe_router_dtype", "moe_router_force_load_balancing", "moe_latent_size",
    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")

# Accepted and ignored: they change no number here (paratron picks its kernels by its own switches, the
# parallel sizes come from parallel_state, the callbacks belong to Megatron's training loop).
ACCEPTED = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None,
    "hierarchical_context_parallel_sizes": None, "perform_initialization": True, "use_cpu_initialization": False,
    "fp16": False, "bf16": False, "pipeline_dtype": None, "autocast_dtype": None, "enable_autocast": False,
    "timers": None, "finalize_model_grads_func": None, "grad_scale_func": None, "no_sync_func": None,
    "grad_sync_func": None, "param_sync_func": None,
    "gradient_accumulation_fusion": False, "async_tensor_model_parallel_allreduce": False, "tp_comm_overlap": False,
    "cross_entropy_loss_fusion": False, "cross_entropy_fusion_impl": "native", "variable_seq_lengths": False,
    "overlap_p2p_comm": False, "batch_p2p_comm": True, "batch_p2p_sync": True, "use_ring_exchange_p2p": False,
    "deallocate_pipeline_outputs": False, "microbatch_group_size_per_vp_stage": None, "barrier_with_L1_time": True,
    "attention_softmax_in_fp32": True, "apply_query_key_layer_scaling": False,
    "bias_activation_fusion": False, "masked_softmax_fusion": False, "persist_layer_norm": False,
    "memory_efficient_layer_norm": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
    "distribute_saved_activations": False, "disable_parameter_transpose_cache": False, "test_mode": False,
    "moe_permute_fusion": False, "moe_router_fusion": False, "moe_per_layer_logging": False,
    "moe_layer_recompute": False, "moe_flex_dispatcher_backend": "deepep", "moe_enable_deepep": False,
    "enable_cuda_graph": False, "cuda_graph_impl": "none", "clone_scatter_output_in_embedding": True,
    "use_te_rng_tracker": False, "config_logger_dir": "", "flash_decode": False,
    "transformer_impl": "transformer_engine",
    "disable_bf16_reduced_precision_matmul": False, "init_model_with_meta_device": False,
}

# Refused unless left at Megatron's default
UNSUPPORTED = {
    "fp32_residual_connection": False, "apply_residual_connection_post_layernorm": False, "softmax_scale": None,
    "init_method": None, "output_layer_init_method": None, "embedding_init_method": None, "qk_l2_norm": False,
    "qk_clip": False, "experimental_attention_variant": None, "linear_attention_freq": None,
    "heterogeneous_block_specs": False, "calculate_per_token_loss": False, "fp8": None, "fp8_param": False,
    "fp4": None, "cpu_offloading": False, "defer_embedding_wgrad_compute": False, "is_hybrid_model": False,
    "num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None,
    "pipeline_model_parallel_layout": None, "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
}

ACTIVATIONS = {  # (activation function's name, gated) -> ModelConfig switches
    ("gelu", False): {}, ("openai_gelu", False): {"openai_gelu": True}, ("fast_gelu", False): {"openai_gelu": True},
    ("silu", True): {"swiglu": True}, ("squared_relu", False): {"squared_relu": True},
    ("quick_gelu", True): {"quick_geglu": True},
}


@dataclass
class _Mapped:
    """The fields that shape the model (Megatron's names and defaults); see the module docstring."""
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    num_query_groups: Optional[int] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    num_moe_experts: Optional[int] = None
    moe_layer_freq: Any = 1
    rotary_interleaved: bool = False
    window_size: Optional[tuple] = None
    window_attn_skip_freq: Any = None
    no_rope_freq: Any = None
    normalization: str = "LayerNorm"
    qk_layernorm: bool = False
    attention_output_gate: bool = False
    softmax_type: str = "vanilla"
    multi_latent_attention: bool = False
    init_method_std: float = 0.02
    embedding_init_method_std: Optional[float] = None
    use_mup: bool = False
    mup_width_mult: float = 1.0
    mup_base_hidden_size: Optional[int] = None
    mup_embedding_mult: float = 1.0
    mup_output_mult: float = 1.0
    mup_base_head_dim: Optional[float] = None
    mup_attn_scale_power: float = 1.0
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    mtp_use_repeated_layer: bool = False
    mtp_detach_heads: bool = False
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: Optional[float] = None
    moe_token_dispatcher_type: str = "allgather"
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_overlap: bool = False
    overlap_moe_expert_parallel_comm: bool = False  # the schedule's turns (paratron/parallel/turns.py)
    delay_wgrad_compute: bool = False  # the experts' weight gradients under the dispatch's backward all-to-all
    overlap_dispatch_backward_with_experts_wgrad: bool = False  # experts' wgrad under the dispatch backward all-to-all
    moe_shared_expert_gate: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_router_dtype: Optional[str] = None
    moe_router_force_load_balancing: bool = False
    moe_latent_size: Optional[int] = None
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # to paratron's GPTModel arguments
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[list] = None  # selective: Megatron's default ["core_attn"]
    fine_grained_activation_offloading: bool = False
    offload_modules: Optional[list] = None
    min_offloaded_tensor_size: int = 1024 * 1024
    activation_offload_fraction: float = 1.0
    # to paratron's kernel switches (kernel_config)
    attention_backend: Any = "auto"
    deterministic_mode: bool = False

    def __post_init__(self):
        for name, default in UNSUPPORTED.items():
            if getattr(self, name) != default:
                raise ConfigError(f"TransformerConfig({name}={getattr(self, name)!r}) is not supported by "
                                  f"paratron.core (leave it at {default!r})")
        if not (self.num_layers and self.hidden_size and self.num_attention_heads):
            raise ConfigError("TransformerConfig needs num_layers, hidden_size and num_attention_heads")
        self._activation()  # refused early, by name
        self._backend()

    def _backend(self) -> str:
        """``attention_backend`` as --attention-backend's value (Megatron's AttnBackend member or its name)."""
        name = getattr(self.attention_backend, "name", self.attention_backend)
        name = "auto" if name is None else str(name)
        if name not in CHOICES["attention_backend"]:
            raise ConfigError(f"TransformerConfig(attention_backend={name!r}): paratron.core takes one of "
                              + ", ".join(CHOICES["attention_backend"]))
        return name

    def kernel_config(self, device, dtype) -> KernelConfig:
        """The kernel switches of a model on ``device`` in ``dtype``: ``attention_backend`` as asked, every other
        switch ``auto`` resolved there (deterministic mode: the paths a --deterministic-mode run takes)."""
        asked = KernelConfig(attention_backend=self._backend())
        return switches.resolve(asked, device if device is not None else "cpu", dtype, bool(self.deterministic_mode))

    def _activation(self) -> dict:
        name = getattr(self.activation_func, "__name__", repr(self.activation_func))
        switches = ACTIVATIONS.get((name, bool(self.gated_linear_unit)))
        if switches is None:
            raise ConfigError(f"TransformerConfig(activation_func={name}, gated_linear_unit={self.gated_linear_unit})"
                              " is not supported by paratron.core; it has " + ", ".join(
                                  f"{a}{' gated' if g else ''}" for a, g in ACTIVATIONS))
        return switches

    def _feature_on(self, name: str) -> bool:
        """A feature's fields go over only with the feature (paratron refuses MoE flags without experts)."""
        for prefix, on in (("moe_", self.num_moe_experts), ("mtp_", self.mtp_num_layers), ("mup_", self.use_mup)):
            if name.startswith(prefix):
                return bool(on)
        if name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            return self.multi_latent_attention
        return True

    def model_fields(self) -> dict:
        """The ModelConfig fields this config sets (GPTModel adds the position and vocabulary ones)."""
        out = {name: getattr(self, name) for name in SAME_NAME if self._feature_on(name)}
        out.update(self._activation(), norm_epsilon=self.layernorm_epsilon, num_experts=self.num_moe_experts,
                   apply_layernorm_1p=self.layernorm_zero_centered_gamma, disable_bias_linear=not self.add_bias_linear,
                   **({"moe_layer_freq": str(self.moe_layer_freq)} if self.num_moe_experts else {}))
        if self.num_query_groups is not None and self.num_query_groups != self.num_attention_heads:
            out.update(group_query_attention=True, num_query_groups=self.num_query_groups)
        if self.window_size is not None:
            out["window_size"] = ",".join(str(int(w)) for w in self.window_size)
        for name in ("window_attn_skip_freq", "no_rope_freq"):
            if getattr(self, name) is not None:
                out[name] = str(getattr(self, name))
        return out

    def train_section(self, model: ModelConfig) -> TrainConfig:
        """The recomputation and activation-offloading fields as paratron's train section, checked by the same rules
        as the command line's (config/check_train.validate_recompute, config/check_offload) for ``model``."""
        names = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                 "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
                 "activation_offload_fraction")
        cfg = Config(model=model, train=TrainConfig(**{n: getattr(self, n) for n in names}))
        validate_recompute(cfg)
        validate_activation_offload(cfg)
        return cfg.train

    def model_config(self, max_sequence_length: int, **model_fields) -> ModelConfig:
        """The resolved ModelConfig of a model with ``max_sequence_length`` positions (``model_fields``:
        the GPTModel's own choices, position embedding and tied output layer)."""
        fields = dict(self.model_fields(), seq_length=max_sequence_length,
                      max_position_embeddings=max_sequence_length, **model_fields)
        return ModelConfig(**fields).resolved()


TransformerConfig = dataclasses.make_dataclass(
    "TransformerConfig", [(name, Any, field(default=default)) for name, default in {**ACCEPTED, **UNSUPPORTED}.items()],
    bases=(_Mapped,), namespace={"__doc__": __doc__.split("\n\n")[0], "__module__": __name__})

"""The config's sections: dataclasses whose field names are Megatron-LM's flag names.

``--hidden-size 1024`` on the command line, ``hidden_size: 1024`` in YAML and ``cfg.model.hidden_size`` in Python
are the same setting. Fields are grouped in sections (model, parallel, train, optim, data, log, ckpt, kernels); every
name is unique across sections, so a flat YAML file or command line maps onto exactly one field. ``Config.flat()``
gives Megatron's flat ``args`` view. A config is writable while built; ``resolve()`` (config/resolution.py)
validates it, derives every value and freezes every section (later writes raise :class:`FrozenConfigError`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import ConfigError
from .hybrid_fields import HybridFields
from .encdec import EncoderDecoderFields
from .data_fields import DataFileFields
from .fp8_fields import FP8Fields
from .graph_fields import GraphFields
from .log_fields import MonitorFields
from .offload_fields import OffloadFields
from .optim_fields import PrecisionAwareFields
from .kernels import KernelConfig
from .section_base import Section, base_type, flag  # noqa: F401  (flag, base_type: imported from here)


@dataclass(eq=True)
class ModelConfig(Section, HybridFields, EncoderDecoderFields):
    _name = "model"
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: Optional[int] = None  # default 4*hidden, or Megatron's 2/3 rule with --swiglu
    num_attention_heads: int = 4
    kv_channels: Optional[int] = None  # head dim; default hidden/heads
    group_query_attention: bool = False
    num_query_groups: Optional[int] = None
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None  # default seq_length
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | yarn | none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False  # RoFormer-style: rotate interleaved pairs of dimensions (not the two halves)
    rotary_seq_len_interpolation_factor: Optional[float] = None  # RoPE positions divided by this (interpolation)
    no_rope_freq: Optional[str] = None  # layers without RoPE (Llama 4's NoPE): N = every Nth, or a 0/1 list (1 = none)
    use_rope_scaling: bool = False  # Llama-3.1-style frequency scaling
    rope_scaling_factor: float = 8.0
    rope_type: Optional[str] = None  # rope (standard attention); multi-latent attention: rope | yarn (default yarn)
    # YaRN (--position-embedding-type yarn; paratron/model/yarn.py), Megatron's defaults when unset
    rotary_scaling_factor: float = 1.0  # YaRN: context extension factor
    yarn_original_max_position_embeddings: Optional[int] = None  # YaRN: positions of pre-training (default 4096)
    yarn_beta_fast: Optional[float] = None  # YaRN: rotations where the ramp starts (default 32)
    yarn_beta_slow: Optional[float] = None  # YaRN: rotations where the ramp ends (default 1)
    yarn_correction_range_round_to_int: bool = True  # YaRN: floor/ceil the ramp ends (--no-... keeps fractions)
    mscale: float = 1.0  # YaRN: attention-factor coefficient (numerator)
    mscale_all_dim: float = 0.0  # YaRN: attention-factor coefficient (denominator)
    enable_gpt_oss: bool = False  # GPT-OSS preset: YaRN with HF gpt-oss's values (factor 32 over 131072 positions)
    window_size: Optional[str] = None  # sliding window (model/core_attention.py): "LEFT,RIGHT" (-1: unbounded), 127,0
    window_attn_skip_freq: Optional[str] = None  # int N (every Nth layer full) or a 0/1 list expression (1 = window)
    softmax_type: str = "vanilla"  # vanilla | off-by-one | learnable (per-head sink logits)
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximate GeLU (GPT-2's "gelu_new")
    qk_layernorm: bool = False
    no_bias_swiglu_fusion: bool = False  # SwiGLU as torch ops instead of paratron's Triton kernel (CUDA)
    no_bias_gelu_fusion: bool = False  # FP8: GeLU (+ fc1 bias) as torch ops instead of the fused FP8 MLP kernels
    no_bias_dropout_fusion: bool = False  # add the residual after fc2 instead of as fc2's matmul operand
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False  # keep QKV bias even with --disable-bias-linear (Qwen2)
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    embedding_init_method_std: Optional[float] = None  # the embeddings' init std (default --init-method-std)
    # muP, maximal-update parameterisation (paratron/model/mup.py; Megatron's names and rules)
    use_mup: bool = False  # width-scaled init, attention 1/d, logit and embedding multipliers, hidden LR and eps / m
    mup_base_hidden_size: Optional[int] = None  # the width the hyperparameters were tuned at (default --hidden-size)
    mup_width_mult: float = 1.0  # m = --hidden-size / --mup-base-hidden-size (computed; a value given must equal it)
    mup_embedding_mult: float = 1.0  # the embeddings times this
    mup_output_mult: float = 1.0  # the logits times this (left at 1.0: 1/m, as Megatron)
    mup_base_head_dim: Optional[float] = None  # attention scale sqrt(this) / d ** power (None: 1 / d ** power)
    mup_attn_scale_power: float = 1.0  # 1.0: muP's 1/d; 0.5: the standard 1/sqrt(d)
    make_vocab_size_divisible_by: int = 128
    num_experts: Optional[int] = None  # mixture of experts (docs/moe.md); None: every layer dense
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None  # default --ffn-hidden-size
    moe_layer_freq: str = "1"  # int k (layers 0, k, 2k... MoE) or a list expression such as ([0]*1+[1]*3)*4
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | none
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k (else top-k logits, softmax)
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False  # DeepSeek-V3's aux-loss-free balancing
    moe_router_bias_update_rate: float = 1e-3
    moe_router_dtype: Optional[str] = None  # fp32 | fp64 (router logits and scores); None: the model dtype
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_overlap: bool = False  # alltoall EP: the shared expert (fwd, bwd) under the dispatch all-to-all
    overlap_moe_expert_parallel_comm: bool = False  # alltoall EP: all-to-alls under another micro-batch's compute
    delay_wgrad_compute: bool = False  # the experts' weight gradients under the dispatch's backward all-to-all
    overlap_dispatch_backward_with_experts_wgrad: bool = False  # experts' wgrad under the dispatch backward all-to-all
    moe_grouped_gemm: bool = False  # torch._grouped_mm where available, else a loop over experts
    moe_permute_fusion: bool = False  # grouped GEMM: tokens gathered straight into the padded expert rows and back
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather | flex (runs as alltoall)
    moe_flex_dispatcher_backend: str = "deepep"  # deepep | hybridep | ncclep: checked as Megatron, then alltoall
    moe_enable_deepep: bool = False  # Megatron's older spelling of --moe-flex-dispatcher-backend deepep (flex only)
    moe_router_num_groups: Optional[int] = None  # group-limited routing: the experts in this many groups
    moe_router_group_topk: Optional[int] = None  # ... each token choosing its experts in this many groups
    moe_router_force_load_balancing: bool = False  # benchmarking: random router logits (straight-through grad)
    moe_input_jitter_eps: Optional[float] = None  # training: the router's input times U(1 - eps, 1 + eps) noise
    moe_shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x . gate_weight) (Qwen2-MoE)
    moe_latent_size: Optional[int] = None  # routed experts work in this width between two projections (latent MoE)
    use_rotary_position_embeddings: bool = False  # Megatron's deprecated = --position-embedding-type rope
    no_position_embedding: bool = False  # no learned position table: accepted with rope (as Megatron), else an error
    # Megatron's norm, activation and attention variants (paratron/model/variants.py)
    apply_layernorm_1p: bool = False  # zero-centred norm weights: stored w (initialised 0), applied as 1 + w
    squared_relu: bool = False  # relu(x)^2 MLP activation
    quick_geglu: bool = False  # gated x*sigmoid(1.702x) (gpt-oss): quick_gelu(gate) * (up + --glu-linear-offset)
    glu_linear_offset: float = 0.0  # added to the linear half of a gated MLP before the product
    activation_func_clamp_value: Optional[float] = None  # gated MLP: gate clamped to <= v, linear half to [-v, v]
    attention_output_gate: bool = False  # attention output times sigmoid(gate); the gate is a 4th part of QKV
    multi_latent_attention: bool = False  # DeepSeek's MLA (model/mla.py) in place of the fused-QKV attention
    q_lora_rank: Optional[int] = None  # rank of the compressed query (none: one plain query projection)
    kv_lora_rank: int = 32  # rank of the compressed keys and values
    qk_head_dim: int = 128  # per-head query/key dimension without the rotary part
    qk_pos_emb_head_dim: int = 64  # per-head rotary query/key dimension (one rotary key shared by all heads)
    v_head_dim: int = 128  # per-head value dimension
    mtp_num_layers: Optional[int] = None  # DeepSeek-V3 MTP depths (model/mtp.py): each predicts one token further
    mtp_loss_scaling_factor: float = 0.1  # the MTP losses' weight: factor / depths x their sum joins the loss
    mtp_use_repeated_layer: bool = False  # one MTP layer applied at every depth (weights shared)
    mtp_detach_heads: bool = False  # the MTP losses train the MTP layers only; their gradients clipped by their own norm

    def resolved(self, **changes) -> "ModelConfig":
        """This model config validated, with Megatron's derived defaults (head dim, FFN size, query
        groups, max positions) filled, frozen: itself when already resolved and nothing changes,
        else a new object (``changes`` applied to the values as given first)."""
        if self.is_resolved and not changes:
            return self
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"ModelConfig has no field {unknown[0]}")
        from .resolution import resolve_model  # (resolution.py builds on this module)
        out = self.unfrozen()
        for name, value in changes.items():
            setattr(out, name, value)
        return resolve_model(out)


TransformerConfig = ModelConfig  # Megatron's name for the model-shape config


@dataclass(eq=True)
class ParallelConfig(Section):
    _name = "parallel"
    local_rank: Optional[int] = None  # the legacy launcher's --local-rank (torch.distributed.launch); LOCAL_RANK wins
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    num_virtual_stages_per_pipeline_rank: Optional[int] = None  # the virtual pipeline size, Megatron's newer name
    microbatch_group_size_per_virtual_pipeline_stage: Optional[int] = None  # interleaved: group size (default PP)
    pipeline_model_parallel_layout: Optional[str] = None  # Megatron's layout string, e.g. "Et*3|(tt|)*2,t|tL"
    account_for_embedding_in_pipeline_split: bool = False  # the embedding counts as a layer of the first stage
    account_for_loss_in_pipeline_split: bool = False  # the loss counts as a layer of the last stage
    use_tp_pp_dp_mapping: bool = False  # rank order tp-cp-ep-pp-dp (DP varies slowest) instead of tp-cp-ep-dp-pp
    context_parallel_size: int = 1  # the sequence split over CP ranks (paratron/parallel/context.py)
    cp_comm_type: str = "p2p"  # p2p (ring attention) | a2a (Ulysses) | allgather (K/V gathered) | a2a+p2p (hierarchical); or one per layer
    hierarchical_context_parallel_sizes: Optional[list] = None  # a2a+p2p: [all-to-all size, ring size]
    expert_model_parallel_size: int = 1  # experts split over this many ranks (docs/moe.md)
    expert_tensor_parallel_size: Optional[int] = None  # each expert FFN split over this many ranks; default TP
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_megatron_fsdp: bool = False  # sharded data parallelism (--data-parallel-sharding-strategy; paratron's own code)
    data_parallel_sharding_strategy: str = "no_shard"  # no_shard | optim | optim_grads | optim_grads_params (ZeRO-0..3)
    fp8_param_gather: bool = False  # FP8 linear weights all-gathered in FP8 with their scales (ZeRO-1/3 and FP8)
    no_gradient_accumulation_fusion: bool = False  # weight gradients via param.grad + an add, not into main_grad
    ddp_bucket_size: Optional[int] = None
    ddp_num_buckets: Optional[int] = None  # instead of --ddp-bucket-size: this rank's parameters / N per bucket
    ddp_pad_buckets_for_high_nccl_busbw: bool = False  # bucket ends padded to a multiple of 2^16 elements too
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False  # bf16 gradient buffer and reduction (needs --bf16)
    distributed_backend: Optional[str] = None  # nccl on GPU, gloo on CPU when not given
    distributed_timeout_minutes: float = 10.0  # every process group and pipeline wait; fractions allowed
    disable_gloo_process_groups: bool = False  # checkpoint collectives on the default backend, not their gloo group


@dataclass(eq=True)
class TrainConfig(Section, FP8Fields, OffloadFields, GraphFields):
    _name = "train"
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # default micro_batch_size * data-parallel size
    rampup_batch_size: Optional[list] = None
    step_batch_size_schedule: Optional[str] = None  # "THRESHOLD:BS ..." thresholds in tokens (K/M/B/T suffixes)
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 100
    eval_global_batch_size: Optional[int] = None  # samples of an evaluation step (default: --global-batch-size's)
    start_eval_at_iter: Optional[int] = None  # no evaluation before this iteration
    skip_train: bool = False  # evaluate the model as loaded (validation and test), do not train
    iterations_to_skip: Optional[list] = None  # these steps (1-based) read their batch and train nothing
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False  # --exit-signal: finish the step, save, exit 0 (DataLoader workers ignore it)
    exit_signal: str = "SIGTERM"  # the signal --exit-signal-handler catches (a signal.Signals name)
    exit_signal_handler_for_dataloader: bool = False  # DataLoader workers ignore --exit-signal (implied by the above)
    check_for_nan_in_loss_and_grad: bool = True  # stop on a NaN/Inf loss (or grad norm, unless --fp16)
    check_for_spiky_loss: bool = False  # report a loss above --spiky-loss-factor x the running max
    spiky_loss_factor: float = 10.0  # paratron: Megatron's fixed factor, made a flag
    exit_on_spiky_loss: bool = False  # paratron: a spiky loss stops the run (else it is reported)
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # fixed fp16 loss scale; dynamic when not given
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    recompute_activations: bool = False
    recompute_granularity: Optional[str] = None  # full | selective
    recompute_method: Optional[str] = None  # uniform | block
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[list] = None  # selective recompute of: core_attn (default), layernorm, mlp, moe, ...
    moe_layer_recompute: bool = False  # Megatron's older spelling: selective recomputation of the MoE layers ("moe")
    check_weight_hash_across_dp_replicas_interval: Optional[int] = None  # every N steps: equal weights on every DP rank
    device: Optional[str] = None  # paratron: cuda | cpu; default cuda when available
    cpu_threads: Optional[int] = None  # paratron: torch's intra-op threads on CPU; default: cores / local processes
    torch_compile: bool = False  # paratron: torch.compile each transformer layer (regional compilation)
    no_fused_output_loss: bool = False  # paratron: plain logits + cross-entropy instead of the chunked fused path
    calculate_per_token_loss: bool = False  # loss = sum over the step's tokens / their count (else per micro-batch mean)
    deterministic_mode: bool = False  # torch.use_deterministic_algorithms: bitwise-repeatable runs
    manual_gc: bool = False  # Python's automatic garbage collector off; collect every --manual-gc-interval steps
    manual_gc_interval: int = 0  # 0: collect only at checkpoints and evaluations
    train_sync_interval: Optional[int] = None  # every N steps the host waits for the GPU (at most N steps ahead)
    no_manual_gc_eval: bool = False  # with --manual-gc: no collection around evaluations
    empty_unused_memory_level: int = 0  # 1: return cached CUDA memory after each step; 2: also after evaluation
    disable_bf16_reduced_precision_matmul: bool = False  # with --bf16: bf16 matmuls reduce in fp32 (torch backend flag)
    dry_run: bool = False  # paratron: print the memory plan (docs/plan.md), then stop before building the model


@dataclass(eq=True)
class OptimConfig(Section, PrecisionAwareFields):
    _name = "optim"
    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: float = 0.0
    lr_decay_style: str = "linear"  # constant | linear | cosine | inverse-square-root | WSD
    lr_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"  # linear | cosine | exponential | minus_sqrt
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    optimizer_cpu_offload: bool = False  # fp32 masters and Adam moments on the host; their update runs there
    optimizer_offload_fraction: float = 1.0  # with --optimizer-cpu-offload: the share of master elements offloaded
    clip_grad: float = 1.0
    override_opt_param_scheduler: bool = False  # on resume: the command line's LR schedule
    use_checkpoint_opt_param_scheduler: bool = False  # on resume: the checkpoint's LR schedule
    decoupled_lr: Optional[float] = None  # peak LR of the word embedding and output layer (same schedule shape)
    decoupled_min_lr: Optional[float] = None  # their minimum LR (default --min-lr); needs --decoupled-lr
    apply_wd_to_qk_layernorm: bool = False  # weight decay on the q/k layernorm weights and biases too
    muon_momentum: float = 0.9  # Muon's (--optimizer muon | dist_muon; optim/muon.py) momentum coefficient
    muon_split_qkv: bool = True  # --muon-no-split-qkv: orthogonalise the fused QKV matrix whole
    muon_nesterov: bool = False  # Nesterov momentum: orthogonalise (1 - m) g + m M instead of M
    muon_scale_mode: str = "spectral"  # spectral | unit_rms_norm | shape_scaling
    muon_fp32_matmul_prec: str = "medium"  # medium: Newton-Schulz in bf16; high | highest: fp32
    muon_coefficient_type: str = "quintic"  # simple | quintic | polar_express | cans | aol | deepseekv4 | cubic5
    muon_num_ns_steps: int = 5  # Newton-Schulz iterations
    muon_tp_mode: str = "duplicated"  # duplicated | distributed: whole matrices; blockwise: each TP shard alone
    muon_use_syrk: bool = False  # a Gram-matrix kernel choice: the same numbers
    muon_extra_scale_factor: float = 1.0  # multiplies Muon's update (after --muon-scale-mode's factor)
    muon_scalar_optimizer: str = "adam"  # the optimizer of the non-matrix parameters (adam)


@dataclass(eq=True)
class DataConfig(Section, DataFileFields):
    _name = "data"
    data_path: Optional[list] = None
    split: str = "969,30,1"
    train_data_path: Optional[list] = None
    valid_data_path: Optional[list] = None
    test_data_path: Optional[list] = None
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    num_workers: int = 2
    dataloader_type: Optional[str] = None  # single (default: the samples in order) | cyclic (reshuffled each epoch)
    no_data_sharding: bool = False  # cyclic: each rank draws from the whole dataset, not its own bucket
    # Fill-in-the-middle samples (paratron/data/fim.py; Megatron's names and defaults)
    fim_data: bool = False  # rewrite samples as prefix/suffix/middle with FIM sentinel tokens
    fim_rate: float = 0.5  # the chance a document (or, with --fim-split-sample, a sample) is rewritten
    fim_spm_rate: float = 0.5  # the chance a rewritten one is SPM (suffix first) rather than PSM
    fim_split_sample: Optional[str] = None  # a token that splits a document into fragments rewritten one by one
    fim_fragment_rate: Optional[float] = None  # with --fim-split-sample: the chance per fragment
    fim_no_prefix: Optional[str] = None  # text that exempts a document or fragment starting with it
    fim_prefix_token: str = "<fim_prefix>"  # the FIM sentinel before the prefix (a token of the tokenizer)
    fim_middle_token: str = "<fim_middle>"  # the FIM sentinel before the middle
    fim_suffix_token: str = "<fim_suffix>"  # the FIM sentinel before the suffix
    fim_pad_token: str = "<fim_pad>"  # pads a rewritten sample that came out shorter (no loss on it)
    fim_eod_token: str = "<|endoftext|>"  # where FIM cuts a sample into documents
    # Supervised fine-tuning (paratron/data/sft.py): the data paths are JSONL files of chat conversations
    sft: bool = False  # samples are conversations packed per line, the loss on the assistant turns only
    sft_tokenizer_prompt_format: str = "nemotron-h-aligned"  # the chat format: nemotron-h-aligned | nemotron-nano-v2 | identity | default (the tokenizer's chat_template)
    # The tokenizer flags (TOKENIZER_FIELDS): the same set, defaults and meaning in `paratron preprocess`.
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None  # resolve() sets the tokenizer's vocabulary size
    padded_vocab_size: Optional[int] = None  # the model's vocabulary rows (default: the padding of Megatron's)
    null_tokenizer_eod_id: Optional[int] = None
    vocab_extra_ids: int = 0  # SentencePieceTokenizer: <extra_id_i> tokens added
    tiktoken_pattern: str = "v2"  # TikTokenizer: v1 | v2
    tiktoken_num_special_tokens: int = 1000
    tokenizer_special_tokens: Optional[list] = None
    tokenizer_hf_no_include_special_tokens: bool = False  # HuggingFaceTokenizer: no BOS/EOS added to the text's ids
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    no_mmap_bin_files: bool = False  # read each .bin file into memory instead of memory-mapping it
    no_token_id_check: bool = False  # paratron: skip the check of each micro-batch's ids against the vocabulary
    mask_prob: float = 0.15  # BERT: the share of tokens masked (of them 0.8 [MASK], 0.1 a random id, 0.1 kept); T5: in spans
    short_seq_prob: float = 0.1  # BERT / T5: the chance a sample's target length is drawn shorter than the longest


TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size",
                    "null_tokenizer_eod_id", "vocab_extra_ids", "tiktoken_pattern", "tiktoken_num_special_tokens",
                    "tokenizer_special_tokens", "tokenizer_hf_no_include_special_tokens")


@dataclass(eq=True)
class LogConfig(Section, MonitorFields):
    _name = "log"
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    log_throughput: bool = False  # TFLOP/s, tokens/s and MFU to TensorBoard (the log line always has them)
    log_params_norm: bool = False  # the L2 norm of the weights in the log line and TensorBoard
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: Optional[list] = None  # the global ranks --profile traces (default: every rank)
    record_memory_history: bool = False  # CUDA allocator history; a snapshot per rank every log interval and at OOM
    memory_snapshot_path: str = "snapshot.pickle"  # --record-memory-history: <base>_<rank><ext> (_oom_rank_ at OOM)
    log_progress: bool = False  # append job progress (start, checkpoints: throughput, tokens) to <save>/progress.txt
    plot_path: Optional[str] = None  # paratron: PNG loss plot; default <tensorboard-dir or save>/loss.png
    sample_prompt: Optional[str] = None  # paratron: the trained model continues this text at the end (greedy)
    # Megatron's TensorBoard / W&B reporting (paratron/train/reporting.py), Megatron's tags
    tensorboard_log_interval: int = 1  # write the TensorBoard/W&B scalars every N iterations
    moe_per_layer_logging: bool = False  # each MoE layer's aux losses as moe/<name>_layer_<i> scalars too
    tensorboard_queue_size: int = 1000  # events buffered before the writer flushes
    timing_log_level: int = 0  # timers: 1 forward-backward, all-grads-sync (DP comm), optimizer; 2 + batch-generator
    timing_log_option: str = "minmax"  # max | minmax | all (accepted: TensorBoard gets each timer's max over ranks)
    log_timers_to_tensorboard: bool = False  # <timer>-time, iteration-time (and throughput with --log-throughput)
    log_num_zeros_in_grad: bool = False  # num-zeros: gradient entries equal to zero
    log_memory_to_tensorboard: bool = False  # mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes, ...
    log_memory_interval: Optional[int] = None  # every N iterations (a multiple of --log-interval): a memory line
    log_validation_ppl_to_tensorboard: bool = False  # lm loss validation ppl
    log_world_size_to_tensorboard: bool = False  # world-size
    no_log_loss_scale_to_tensorboard: bool = False  # leave out loss-scale
    wandb_project: Optional[str] = None  # Weights & Biases project (optional wandb package; offline without network)
    wandb_exp_name: Optional[str] = None  # W&B run name
    wandb_save_dir: Optional[str] = None  # W&B files; default <--save>/wandb
    wandb_entity: Optional[str] = None  # W&B team or user
    logging_level: Optional[int] = None  # Python logging level of the run (10 debug, 20 info, 30 warning)


@dataclass(eq=True)
class CheckpointConfig(Section):
    _name = "ckpt"
    save: Optional[str] = None
    load: Optional[str] = None
    pretrained_checkpoint: Optional[str] = None  # fine-tune from its latest checkpoint when --load holds none
    save_interval: Optional[int] = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    async_save: bool = False  # write in a background thread while training goes on
    ckpt_format: str = "torch_dist"  # DCP, sharded (torch_dcp, fsdp_dtensor: the same format)
    ckpt_step: Optional[int] = None  # load this iteration instead of the latest
    exit_on_missing_checkpoint: bool = False  # --load without a checkpoint is an error instead of a fresh start
    ckpt_keep_last: int = 0  # paratron: keep only the newest K checkpoints under --save (0: keep all)
    save_retain_interval: Optional[int] = None  # keep checkpoints at multiples of it; delete the other older ones
    dist_ckpt_strictness: str = "assume_ok_unexpected"  # key mismatches on load: Megatron's StrictHandling values
    use_checkpoint_args: bool = False  # the model's shape and tokenizer from the loaded checkpoint's config
    override_checkpoint_model_args: bool = False  # paratron: load a checkpoint saved with other model flags
    no_save_space_check: bool = False  # paratron: start even when --save has no room for one checkpoint


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "log": LogConfig,
    "ckpt": CheckpointConfig,
    "kernels": KernelConfig,
}


@dataclass(eq=True)
class Config(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    world_size: Optional[int] = None  # the number of processes; resolve() sets it (not a flag)

    def flat(self) -> argparse.Namespace:
        """Megatron's flat ``args`` view of every field (a copy)."""
        out = {}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return argparse.Namespace(**out)

    def set(self, name: str, value: Any) -> None:
        setattr(getattr(self, FIELD_SECTION[name]), name, value)

    def get(self, name: str) -> Any:
        return getattr(getattr(self, FIELD_SECTION[name]), name)

    def to_dict(self) -> dict:
        """Every field by section, as plain Python values (lists are plain lists)."""
        out = {}
        for name in SECTIONS:
            values = dataclasses.asdict(getattr(self, name))
            out[name] = {k: list(v) if isinstance(v, list) else v for k, v in values.items()}
        return out

    def unfrozen(self) -> "Config":
        """A writable copy with every section as given (resolve it again after changing it), for its world size."""
        return Config(**{name: getattr(self, name).unfrozen() for name in SECTIONS}, world_size=self.world_size)

    def with_section(self, name: str, section: Section) -> "Config":
        """A frozen copy of this resolved config with section ``name`` replaced by ``section``, a copy of it
        resolved further by the run (the kernel switches for the device); ``unfrozen()`` still gives the values
        as given."""
        given = getattr(self, name).unfrozen()
        section._freeze({f: getattr(given, f) for f in section.__dataclass_fields__
                         if getattr(given, f) != getattr(section, f)})
        out = dataclasses.replace(self, **{name: section})
        out._freeze({})
        return out

    @property  # derived from frozen fields (never stored, so they cannot go stale), as data_parallel_size
    def padded_vocab_size(self) -> int:
        """--padded-vocab-size (checked in validation), else Megatron's: the next multiple of
        --make-vocab-size-divisible-by x TP."""
        if self.data.padded_vocab_size is not None:
            return self.data.padded_vocab_size
        if self.data.vocab_size is None:
            raise ConfigError("the vocabulary size is not known: resolve the config (or set --vocab-size)")
        multiple = self.model.make_vocab_size_divisible_by * self.parallel.tensor_model_parallel_size
        return int(math.ceil(self.data.vocab_size / multiple) * multiple)

    @property
    def data_parallel_size(self) -> int:
        """world size / (TP x PP x CP), once resolve() has set the world size."""
        if self.world_size is None:
            raise ConfigError("the data-parallel size is not known before resolve(cfg, world_size=...)")
        p = self.parallel
        return self.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                                   * p.context_parallel_size)


FIELD_SECTION: dict[str, str] = {}
FIELD_TYPES: dict[str, Any] = {}
for _sec, _cls in SECTIONS.items():
    _hints = typing.get_type_hints(_cls)
    for _f in dataclasses.fields(_cls):
        assert _f.name not in FIELD_SECTION, f"duplicate config field {_f.name}"
        FIELD_SECTION[_f.name] = _sec
        FIELD_TYPES[_f.name] = _hints[_f.name]


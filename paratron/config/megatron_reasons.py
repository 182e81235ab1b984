"""The reasons of paratron/config/megatron_flags.py: why a Megatron flag that is not a config field is
accepted (paratron already does what it asks) or refused (planned, GPU-only, not applicable)."""
from __future__ import annotations

from .inference import FIELDS as SERVE_FIELDS

SDPA = ("attention runs through torch's scaled_dot_product_attention, which picks the flash, memory-efficient or math "
        "kernel itself (training on H100/H200 with paratron[hopper]: FlashAttention-4's kernels)")
ONE_IMPL = "paratron has one transformer implementation (PyTorch modules with its own kernels): every name selects it"
NO_KERNEL = "paratron has no such fused kernel: the plain PyTorch path runs, which is what the flag asks"
SCHEDULING = "a kernel or scheduling choice with the same numbers: paratron's one path computes the same result"


FLEX_KERNELS = ("a setting of the flex dispatcher's DeepEP / HybridEP kernels (the SMs or blocks they use): paratron's "
                "flex dispatcher checks its flags as Megatron and runs paratron's alltoall, which has no such kernels; "
                "the same tokens reach the same experts")

# Accepted: parsed, and paratron's only behaviour is what the flag asks.
ACCEPTED = {
    "transformer_impl": ONE_IMPL,
    "use_mcore_models": "paratron's model is the Megatron-Core GPT model (the only one)",
    "use_flash_attn": SDPA + " (FlashAttention on GPUs that have it)",
    "no_masked_softmax_fusion": NO_KERNEL + " (SDPA applies the causal mask itself)",
    "no_persist_layer_norm": NO_KERNEL,
    "attention_softmax_in_fp32": "SDPA's kernels compute the softmax in fp32 for bf16/fp16 inputs (the math kernel "
                                 "upcasts); the flag asks for exactly that",
    "apply_query_key_layer_scaling": "the softmax is computed in fp32, so scaling Q.K by 1/layer and back changes "
                                     "nothing; paratron skips the round trip",
    "no_create_attention_mask_in_dataloader": "the data loader builds no attention mask (causal attention is SDPA's "
                                              "is_causal); only --reset-attention-mask makes one",
    "cross_entropy_loss_fusion": "paratron's output layer and loss are already one fused, chunked cross-entropy "
                                 "(--no-fused-output-loss turns it off)",
    "cross_entropy_fusion_impl": "paratron's own fused cross-entropy runs for every value (native | te)",
    "moe_router_padding_for_fp8": "paratron's FP8 expert GEMMs always pad each expert's rows with zero rows to the "
                                  "GEMM's alignment (16; 128 under --fp8-recipe blockwise), which changes no output",
    **{name: FLEX_KERNELS for name in ("moe_deepep_num_sms", "moe_hybridep_num_sms",
                                       "moe_hybridep_num_sms_preprocessing", "moe_hybridep_num_blocks_permute",
                                       "moe_hybridep_num_blocks_unpermute")},
    "moe_router_padding_for_quantization": "Megatron's newer name of --moe-router-padding-for-fp8: paratron's FP8 "
                                           "expert GEMMs always pad each expert's rows with zero rows to the GEMM's "
                                           "alignment (16; 128 blockwise), which changes no output",
    "export_force_local_attention": "ModelOpt export's choice of Megatron's local attention module over Transformer "
                                    "Engine's: paratron has one attention implementation of its own, not TE's",
    "moe_router_fusion": SCHEDULING,
    "no_overlap_p2p_communication": "paratron's pipeline sends and receives each schedule slot's tensors as one batch "
                                    "and waits for them before the slot computes: the non-overlapped point-to-point "
                                    "communication the flag asks for (parallel/p2p.py)",
    "use_cpu_initialization": "Megatron initialises full weights on the CPU so that the initial weights do not depend "
                              "on the tensor-parallel size; paratron always initialises each full weight from the "
                              "seed and keeps its shard, so they never do",
    "use_dist_ckpt": "checkpoints are always distributed (torch.distributed.checkpoint, --ckpt-format torch_dist)",
    "auto_detect_ckpt_format": "paratron reads one format (torch_dist) and checks each checkpoint's manifest before "
                               "loading",
    "ckpt_fully_parallel_save": "each rank writes only its own shards (replicated tensors once): the save is spread "
                                "over the data-parallel ranks already",
    "no_ckpt_fully_parallel_save": "how the ranks split the writing, not what is written: the files load the same",
    "ckpt_fully_parallel_load": "each rank reads only the shards it needs",
    "ckpt_assume_constant_structure": "a caching hint for repeated saves; each save writes the same files",
    "use_persistent_ckpt_worker": "--async-save already writes from one background thread of the training process "
                                  "per save; there is no worker process to keep",
    "async_strategy": "--async-save uses paratron's own background writer for every strategy name (nvrx | mcore)",
    "async_ckpt_use_cpu_shm": "where --async-save stages tensors for Megatron's writer process (shared memory): "
                              "paratron's writer is a thread of the training process and stages them in pinned "
                              "CPU memory",
    "dist_ckpt_optim_fully_reshardable": "paratron's optimizer state is saved per parameter in global coordinates: "
                                         "it always reloads at any TP/PP/DP layout",
    "ddp_average_in_collective": "averaging inside the all-reduce or before it gives the same mean gradient",
    "enable_experimental": "paratron gates no features behind it",
    "init_model_with_meta_device": "where initialisation happens, not its values: each rank initialises its own "
                                   "shard of the same weights",
    "num_distributed_optimizer_instances": "paratron's distributed optimizer has one instance (the value 1)",
    "rerun_mode": "paratron does not re-run iterations: --rerun-mode disabled is its behaviour",
    "no_use_tokenizer_model_from_checkpoint_args": "--use-checkpoint-args never takes the tokenizer model path "
                                                   "from the checkpoint",
    "te_rng_tracker": "which class keeps the tensor-parallel regions' random states (Transformer Engine's, which its "
                      "CUDA graphs need): paratron's own tracker (parallel/random.py) keeps them, per region and rank",
    "trust_remote_code": "HuggingFaceTokenizer reads tokenizer.json with the tokenizers library, which runs no code "
                         "from the model repository",
    "no_use_layer_wise_param_layout": "how Megatron's layer-wise Muon optimizer lays its buffers out, not what it "
                                      "computes: paratron's Muon gives the same update in either layout",
    "outer_dp_sharding_strategy": "paratron shards over one data-parallel level (--data-parallel-sharding-strategy), "
                                  "none over an outer one: the value no_shard",
    "fp8_interval": "deprecated in Megatron-LM, which ignores it; paratron updates every FP8 scale every step (the "
                    "value 1)",
    "verify_integrity": "paratron always records every checkpoint file's size and CRC-32 at save and checks them "
                        "all at load (a damaged latest checkpoint falls back to the previous complete one); Megatron's "
                        "SHA-256 manifest is the same check, on request",
    "use_fused_weighted_squared_relu": "a kernel choice: Megatron's fused kernel weighs each expert's squared-ReLU "
                                       "output by its routing probability before fc2, paratron weighs fc2's output "
                                       "(the same product: that kernel requires experts without biases)",
}

# Values an accepted flag may take (others are refused naming the values that hold).
ACCEPTED_VALUES = {
    "outer_dp_sharding_strategy": ("no_shard",),
    "transformer_impl": ("transformer_engine", "local"),
    "cross_entropy_fusion_impl": ("native", "te"),
    "async_strategy": ("nvrx", "mcore"),
    "num_distributed_optimizer_instances": ("1",),
    "rerun_mode": ("disabled",),
    "fp8_interval": ("1",),
}

PLANNED = "planned: {} is not in paratron yet; remove the flag"
NA = "not applicable: {}; remove the flag"
SERVE_ONLY = NA.format("a `paratron serve` flag (the serving engine, paratron/config/inference.py), not a training "
                       "one: give it to paratron serve")
GPU = "GPU-only ({}); paratron does not implement it; remove the flag"

# paratron's own flags that it no longer has, each with why and what to do (refused by name, not as unknown).
RETIRED = {
    "kernel_decode_prefetch": "the fused decode attention's loads ahead (the next cache block; the output projection "
                              "into L2) measured slower than without them and were removed (docs/inference.md, "
                              "\"Tried and left off\"); remove the flag",
}

# Refused by name (the flags GPT/Llama/MoE scripts use most).
REFUSED = {
    "enable_cuda_graph": "per-layer CUDA graphs are not built: --cuda-graph-impl local --cuda-graph-scope "
                         "full_iteration captures the whole forward-backward step; use those instead",
    "external_cuda_graph": "paratron's CUDA graph (--cuda-graph-impl local --cuda-graph-scope full_iteration) is "
                           "its own: graphs captured outside the training step are not supported; remove the flag",
    "optimizer_cuda_graph": "the optimizer step runs outside paratron's CUDA graph (--cuda-graph-impl local captures "
                            "the forward-backward step); remove the flag",
    "tp_comm_overlap": GPU.format("Transformer Engine userbuffers overlap of TP communication"),
    "tp_comm_overlap_cfg": GPU.format("Transformer Engine userbuffers overlap of TP communication"),
    "use_torch_fsdp2": NA.format("paratron shards data parallelism with its own code: --use-megatron-fsdp with "
                                 "--data-parallel-sharding-strategy optim | optim_grads | optim_grads_params"),
    "split_sentences": NA.format("sentence splitting is a preprocessing flag: pass it to paratron preprocess / "
                                  "tools/preprocess_data.py (BERT data)"),
    "cache_mla_latents": NA.format("caching multi-latent attention's compressed latents is an inference choice, not "
                                   "training's (`paratron generate` / `serve` always cache the latents)"),
    "num_speculative_tokens": NA.format("speculative decoding is an inference option: pass --num-speculative-tokens "
                                        "to `paratron generate` / `paratron serve`"),
    "mla_down_proj_fusion": GPU.format("Transformer Engine's fused input norm + MLA down projections"),
    "test_mode": NA.format("Megatron's internal test harness"),
    "checkpoint_activations": NA.format("Megatron-LM removed --checkpoint-activations (it stops); use "
                                        "--recompute-activations or --recompute-granularity / --recompute-method"),
    "batch_size": NA.format("Megatron-LM removed --batch-size (it stops with an error); use --micro-batch-size"),
    "sgd_momentum": NA.format("read only by --optimizer sgd, which paratron refuses"),
    "lion_beta1": NA.format("read only by --optimizer lion, which paratron refuses"),
    "lion_beta2": NA.format("read only by --optimizer lion, which paratron refuses"),
    "fp8_output_proj": GPU.format("the output layer in MXFP8, which needs Blackwell's MX tensor cores"),
    "fp8_quantizer_factory": GPU.format("Transformer Engine's custom quantizer recipes"),
    "keep_fp8_transpose_cache": NA.format("it keeps the FP8 weight transposes of Megatron-FSDP with FP8 parameters, "
                                          "neither of which paratron has"),
    "use_nccl_ub": GPU.format("NCCL user-buffer registration"),
    "fsdp_double_buffer": PLANNED.format("Megatron-FSDP's double-buffered all-gather memory (paratron's ZeRO-3 "
                                         "gives a layer's parameters their memory when it gathers them)"),
    "fsdp_manual_registration": GPU.format("NCCL user-buffer registration of Megatron-FSDP's buffers"),
    "overlap_param_gather_with_optimizer_step": PLANNED.format("overlapping the first all-gather bucket with the "
                                                               "optimizer step"),
    "overlap_p2p_communication_warmup_flush": PLANNED.format("overlapped pipeline warm-up/flush communication"),
    "defer_embedding_wgrad_compute": PLANNED.format("deferred embedding weight-gradient GEMMs"),
    "wgrad_deferral_limit": PLANNED.format("deferred embedding weight-gradient GEMMs"),
    "use_transformer_engine_op_fuser": GPU.format("Transformer Engine's operation fuser"),
    "moe_pad_experts_for_cuda_graph_inference": GPU.format("CUDA-graph inference padding"),
    # implemented by paratron serve (config/inference.py), refused by training
    **{name: SERVE_ONLY for name in SERVE_FIELDS + ("no_inference_dynamic_batching_prefix_caching",)},
}

# Config fields whose only effect is the behaviour paratron always has (read by no other code).
HONOURED_FIELDS = {
    "muon_use_syrk": "a Gram-matrix kernel choice (Triton SYRK) with the same numbers: paratron's Newton-Schulz "
                     "uses plain matmuls",
    "timing_log_option": "paratron writes each timer's maximum over ranks to TensorBoard (Megatron's value for every "
                         "option) and prints no timers in the log line, so no option changes its output",
    "moe_token_dispatcher_type": "alltoall, allgather and flex (run as alltoall) dispatch the same tokens to the "
                                 "same experts; at expert-parallel size 1 all are the identity",
}

# Refused by name prefix (families of flags).
PREFIX_REASONS = (
    ("mamba_", PLANNED.format("this Mamba option (paratron has --mamba-state-dim, --mamba-head-dim, "
                              "--mamba-num-groups and --mamba-num-heads)")),
        ("dsa_", PLANNED.format("DeepSeek sparse attention")),
    ("mtp_", PLANNED.format("this multi-token prediction (MTP) option (paratron has --mtp-num-layers, "
                            "--mtp-loss-scaling-factor and --mtp-use-repeated-layer)")),
    ("cuda_graph", GPU.format("CUDA graph capture")),
    ("megatron_fsdp", PLANNED.format("this Megatron-FSDP option (paratron's sharding is --use-megatron-fsdp with "
                                     "--data-parallel-sharding-strategy)")),
    ("fsdp_", PLANNED.format("this Megatron-FSDP option (paratron's sharding is --use-megatron-fsdp with "
                             "--data-parallel-sharding-strategy)")),
    ("inference_", NA.format("this inference-server option (paratron serve implements --inference-dynamic-batching "
                             "and its block, token, request, prefix-caching and CUDA-graph flags)")),
    ("rl_", NA.format("reinforcement-learning training")),
    ("grpo_", NA.format("reinforcement-learning training (GRPO)")),
    ("moe_routing_trace", PLANNED.format("MoE routing traces")),
)

# Refused by Megatron argument group (everything else of the group).
GROUP_REASONS = {
    "rl": NA.format("reinforcement-learning training"),
    "inference": NA.format("this inference-server option (paratron serve implements --inference-dynamic-batching "
                           "and its block, token, request, prefix-caching and CUDA-graph flags)"),
    "vision": NA.format("vision models (paratron trains GPT-style language models)"),
    "biencoder": NA.format("retrieval biencoder models"),
    "Logits Distillation": PLANNED.format("knowledge distillation"),
    "mla": PLANNED.format("this multi-latent attention option"),
    "In-process restart": NA.format("NVIDIA Resiliency in-process restart (a cluster service)"),
    "ft_package": NA.format("NVIDIA Resiliency fault-tolerance package (a cluster service)"),
    "one logger": NA.format("NVIDIA's one-logger telemetry service"),
    "opentelemetry": NA.format("OpenTelemetry export"),
    "workload inspector": NA.format("NVIDIA's workload inspector service"),
    "fault injector": NA.format("Megatron's fault-injection test harness"),
    "msc": NA.format("NVIDIA multi-storage client"),
    "autoresume": NA.format("NVIDIA ADLR autoresume (a cluster service)"),
    "rerun engine": NA.format("Megatron's rerun state machine"),
    "heterogeneous architecture": PLANNED.format("heterogeneous per-layer architectures"),
    "experimental_attention_variant": PLANNED.format("linear/sparse attention variants"),
    "kitchen": NA.format("NVIDIA Kitchen quantisation"),
    "Transformer-Engine": GPU.format("Transformer Engine options"),
    "modelopt-generic": NA.format("NVIDIA Model Optimizer (ModelOpt) export, quantisation and distillation options "
                                  "of Megatron's post-training builder"),
}

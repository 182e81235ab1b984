"""One line of help per config field: :data:`HELP` where written here, else the comment that follows
the field in paratron/config/sections.py (read from its source). ``--help``, docs/config.md and
docs/megatron_flags.md print these lines."""
from __future__ import annotations

import functools
import inspect
import re

from . import (data_fields, encdec, fp8_fields, graph_fields, hybrid_fields, kernels, log_fields, offload_fields,
               optim_fields, sections)

FIELD_MODULES = (sections, kernels, hybrid_fields, encdec, fp8_fields, optim_fields, offload_fields, data_fields,
                 log_fields, graph_fields)

HELP = {
    # model
    "num_layers": "transformer layers", "hidden_size": "width of the residual stream",
    "num_attention_heads": "attention (query) heads", "group_query_attention": "grouped-query attention "
    "(with --num-query-groups)", "num_query_groups": "key/value heads of grouped-query attention",
    "seq_length": "tokens per training sample", "rotary_base": "RoPE base frequency",
    "rotary_percent": "fraction of each head's dimensions that RoPE rotates",
    "rope_scaling_factor": "Llama-3.1 RoPE scaling factor (with --use-rope-scaling)",
    "norm_epsilon": "epsilon of LayerNorm/RMSNorm", "swiglu": "SwiGLU MLP (gate and up projections)",
    "qk_layernorm": "normalise queries and keys per head before attention",
    "disable_bias_linear": "no biases in the linear layers",
    "untie_embeddings_and_output_weights": "a separate output layer instead of the input embedding's transpose",
    "hidden_dropout": "dropout after attention and MLP", "attention_dropout": "dropout of attention probabilities",
    "init_method_std": "standard deviation of the normal weight initialisation",
    "make_vocab_size_divisible_by": "pad the vocabulary to a multiple of this x TP",
    "num_experts": "experts per MoE layer (no flag: dense MLPs)", "moe_router_topk": "experts chosen per token",
    "moe_aux_loss_coeff": "weight of the load-balancing loss", "moe_z_loss_coeff": "weight of the router z-loss",
    "moe_router_topk_scaling_factor": "scale of the chosen experts' weights",
    "moe_router_bias_update_rate": "step of the expert-bias update (--moe-router-enable-expert-bias)",
    "moe_pad_expert_input_to_capacity": "pad every expert's input to its capacity",
    "moe_shared_expert_intermediate_size": "width of the shared expert's MLP (none: no shared expert)",
    # parallel
    "tensor_model_parallel_size": "tensor-parallel ranks (TP)", "pipeline_model_parallel_size": "pipeline stages (PP)",
    "virtual_pipeline_model_parallel_size": "model chunks per pipeline rank (interleaved schedule)",
    "num_layers_per_virtual_pipeline_stage": "layers per virtual pipeline chunk",
    "decoder_first_pipeline_num_layers": "layers of the first pipeline stage (the rest split evenly)",
    "decoder_last_pipeline_num_layers": "layers of the last pipeline stage",
    "sequence_parallel": "shard LayerNorm/dropout activations along the sequence over TP ranks",
    "use_distributed_optimizer": "shard optimizer state over data-parallel ranks (ZeRO-1)",
    "overlap_grad_reduce": "reduce gradient buckets while the backward pass runs",
    "overlap_param_gather": "all-gather parameters of the distributed optimizer while the forward pass runs",
    "no_gradient_accumulation_fusion": "weight gradients through param.grad and an add into the gradient buffer, "
                                       "not added there by the weight-gradient GEMM (Megatron's fusion, on by default)",
    "ddp_bucket_size": "elements per gradient-reduction bucket",
    "accumulate_allreduce_grads_in_fp32": "fp32 gradient buffer and reduction under bf16/fp16",
    "distributed_timeout_minutes": "timeout of collective operations",
    # train
    "micro_batch_size": "samples per forward/backward pass per rank",
    "rampup_batch_size": "START INCREMENT SAMPLES: grow the global batch linearly",
    "train_iters": "training iterations", "train_samples": "training samples (instead of --train-iters)",
    "eval_interval": "iterations between evaluations", "eval_iters": "validation batches per evaluation",
    "exit_interval": "stop when the iteration is a multiple of this",
    "exit_duration_in_mins": "stop (and save) after this many minutes",
    "exit_signal_handler": "save and stop on --exit-signal (SIGTERM)", "seed": "random seed",
    "bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision with loss scaling",
    "initial_loss_scale": "first dynamic loss scale (fp16)", "min_loss_scale": "lowest dynamic loss scale",
    "loss_scale_window": "good steps before the loss scale doubles", "hysteresis": "overflows tolerated before halving",
    "recompute_activations": "selective recomputation of attention (= --recompute-granularity selective)",
    "recompute_num_layers": "layers recomputed per stage or block (--recompute-method)",
    # optim
    "optimizer": "optimizer (adam: AdamW)", "lr": "peak learning rate", "min_lr": "learning rate at the end of decay",
    "lr_decay_iters": "iterations of learning-rate decay", "lr_decay_samples": "samples of learning-rate decay",
    "lr_warmup_iters": "iterations of linear warm-up", "lr_warmup_fraction": "warm-up as a fraction of the decay",
    "lr_warmup_samples": "samples of linear warm-up", "lr_warmup_init": "learning rate at the start of warm-up",
    "lr_wsd_decay_iters": "iterations of the WSD decay phase", "lr_wsd_decay_samples": "samples of the WSD decay phase",
    "weight_decay": "decoupled weight decay (not on biases and norms)", "adam_beta1": "Adam beta1",
    "adam_beta2": "Adam beta2", "adam_eps": "Adam epsilon", "clip_grad": "clip the global gradient norm to this",
    # data
    "data_path": "[WEIGHT] PREFIX ... of indexed datasets (.bin/.idx), split by --split",
    "split": "train,valid,test proportions of --data-path (and --mock-data)",
    "train_data_path": "[WEIGHT] PREFIX ... of training data (no --split)", "valid_data_path": "validation data",
    "test_data_path": "test data", "mock_data": "synthetic random tokens instead of files",
    "data_cache_path": "directory of the dataset index caches", "num_workers": "data-loader worker processes",
    "tokenizer_type": "GPT2BPETokenizer (default with --vocab-file/--merge-file) | HuggingFaceTokenizer | "
                      "SentencePieceTokenizer | GPTSentencePieceTokenizer | Llama2Tokenizer | TikTokenizer | "
                      "NullTokenizer | ByteLevelTokenizer",
    "vocab_file": "GPT2BPETokenizer: vocab.json", "merge_file": "GPT2BPETokenizer: merges.txt",
    "tokenizer_model": "tokenizer.json / directory / .model / .tiktoken file",
    "vocab_size": "NullTokenizer vocabulary; TikTokenizer vocabulary cut",
    "vocab_extra_ids": "SentencePieceTokenizer: number of <extra_id_i> tokens to add",
    "tiktoken_pattern": "TikTokenizer split pattern: v1 | v2",
    "null_tokenizer_eod_id": "NullTokenizer end-of-document id (default vocab size - 1)",
    "tiktoken_num_special_tokens": "TikTokenizer: special-token slots before the vocabulary",
    "tokenizer_special_tokens": "TikTokenizer: names of the special tokens",
    "reset_position_ids": "restart position ids after each end-of-document token",
    "reset_attention_mask": "no attention across end-of-document tokens",
    "eod_mask_loss": "no loss on end-of-document tokens",
    # log
    "log_interval": "iterations between log lines", "tensorboard_dir": "write TensorBoard event files here",
    "profile": "torch.profiler trace from --profile-step-start to --profile-step-end",
    "profile_step_start": "first profiled iteration", "profile_step_end": "iteration after the last profiled one",
    # ckpt
    "save": "checkpoint directory to write", "load": "checkpoint directory to resume from",
    "save_interval": "iterations between checkpoints (0: only at the end, as Megatron)", "finetune": "load weights only; start at iteration 0",
    "no_load_optim": "do not load the optimizer state", "no_load_rng": "do not load the random generators",
    "no_save_optim": "do not save the optimizer state", "no_save_rng": "do not save the random generators",
    # kernel switches (the comments in kernels.py, where one line is too short)
    "kernel_decode_attention": "generation's attention over the KV cache: triton kernel | fused (at batch 1 also the "
    "rotary embedding and the cache write, one kernel: kernels/decode_rotary.py; what auto runs on CUDA in bf16 / "
    "fp16) | fused_qkv (as fused, and at one row with the row GEMVs the QKV projection in the same kernel: "
    "kernels/decode_qkv_attention.py; not yet timed, so auto does not pick it) | sdpa",
}


@functools.lru_cache(maxsize=None)
def _source_comments() -> dict[str, str]:
    """``name: type = default  # comment`` lines of the sections' modules: {name: comment}."""
    out = {}
    for line in "".join(inspect.getsource(module) for module in FIELD_MODULES).splitlines():
        m = re.match(r"    ([a-z][a-z0-9_]*): [^=]+=.*?#\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).replace("paratron: ", "").strip()
    return out


def field_help(name: str) -> str:
    """The one-line description of config field ``name`` ('' when none is written)."""
    return HELP.get(name) or _source_comments().get(name, "")

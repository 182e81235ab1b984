"""The legal values of the config's choice flags, one definition each: the config checks a flag against
its table at resolve, and the module that implements the choice imports the same table."""
from __future__ import annotations

# --tokenizer-type (paratron/data/tokenizers.py) and --tiktoken-pattern
TOKENIZER_TYPES = (
    "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer",
    "ByteLevelTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
)
WORDPIECE_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")  # a BERT vocab.txt (--vocab-file)
MODELS = ("gpt", "bert", "t5")  # --model (pretrain_gpt.py / pretrain_bert.py / pretrain_t5.py)
TIKTOKEN_PATTERNS = ("v1", "v2")

# --sft-tokenizer-prompt-format (paratron/data/sft.py)
SFT_PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "identity", "default")

# --dist-ckpt-strictness (paratron/checkpoint/strictness.py)
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")

# --data-parallel-sharding-strategy (paratron/parallel/data.py): index = what is sharded (ZeRO stage)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def sharding_level(par) -> int:
    """What a resolved parallel section shards over data parallelism: 0 nothing, 1 the optimizer state
    (--use-distributed-optimizer), 2 also the gradients, 3 also the parameters (--use-megatron-fsdp with
    --data-parallel-sharding-strategy)."""
    if par.use_megatron_fsdp:
        return SHARDING_STRATEGIES.index(par.data_parallel_sharding_strategy)
    return int(par.use_distributed_optimizer)


def bucket_end_multiple(pad: bool) -> int:
    """What every gradient bucket's size is also a multiple of: 2^16 elements with
    --ddp-pad-buckets-for-high-nccl-busbw (Megatron's divisor for NCCL's bus bandwidth), else 1."""
    return 2 ** 16 if pad else 1


# --main-grads-dtype, --exp-avg-dtype, --exp-avg-sq-dtype (the precision-aware optimizer: paratron/optim/moments.py)
MAIN_GRADS_DTYPES = ("fp32", "bf16")
MOMENT_DTYPES = ("fp32", "bf16", "fp16", "fp8")
MOMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}  # an element of a moment in memory

# --offload-modules (paratron/model/activation_offload.py), in the order a layer runs them; Megatron's others and
# why paratron has not got them
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
OFFLOAD_MISSING = {"fused_group_mlp": "the fused grouped MLP of Transformer Engine's operation fuser",
                   "gdp_qkv": "gated-delta-product attention (paratron has none)"}

# --cp-comm-type (paratron/parallel/context.py)
COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")

# --softmax-type (paratron/model/core_attention.py)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")

# --recompute-modules (paratron/model/recompute.py): checkpointed modules, output-discarding ones
RECOMPUTE_CHECKPOINTED = ("core_attn", "mlp", "moe", "shared_experts")
RECOMPUTE_DISCARDED = ("layernorm", "moe_act", "mla_up_proj")
RECOMPUTE_SUPPORTED = RECOMPUTE_CHECKPOINTED + RECOMPUTE_DISCARDED
RECOMPUTE_MISSING = {  # Megatron's other names: the module they recompute is not in paratron
    "gdn_norm_out": "gated-delta-net attention (paratron has none)",
    "gdp_in_proj": "gated-delta-product attention (paratron has none)",
    "gdp_qkv": "gated-delta-product attention (paratron has none)",
    "mhc": "hyper-connections (paratron has none)",
}

# --fp8-format, --fp8-recipe, --fp8-amax-compute-algo (the FP8 layers; paratron/parallel/fp8.py keeps a copy
# until it moves to paratron/fp8/, which imports these)
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")
BLOCKWISE_TILE = 128  # the blockwise recipe's tile: its GEMMs' sizes and tokens are whole tiles (check_train.py)
FP8_REFUSED_RECIPES = {  # Megatron's other choices: why paratron refuses them
    "mxfp8": "mxfp8 (per-32-element e8m0 scales) needs Blackwell's MX tensor cores; Hopper has none",
}
FP8_AMAX_ALGOS = ("max", "most_recent")

"""``resolve()``: validate each section, compute every derived value once, then freeze the config.

Derived here and nowhere else: the head dim, FFN size, query groups and max positions (model); the
virtual pipeline size from ``--num-layers-per-virtual-pipeline-stage``; sequence parallelism off at
TP 1 (as Megatron); the recompute granularity of ``--recompute-activations``; the NullTokenizer
default of mock data; from the world size, the data-parallel size, the global batch default and
``--train-iters`` of ``--train-samples``; and the vocabulary size of the tokenizer. After
``resolve()`` no module writes to the config (a write raises FrozenConfigError).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import sys
from typing import Optional

from ..errors import ConfigError
from .ranges import check_ranges
from .validate_attnvar import validate_attention_variants
from .validate_mup import validate_mup
from .validate_sched import changed_flags, check_mapping, schedule_batches, schedule_of, validate_rampup, \
    validate_sched
from .kernels import check_kernels
from .sections import SECTIONS, Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig, flag
from .validate_mla import validate_mla
from .validate_norms import validate_optimizer, validate_run_variants, validate_variants

TIKTOKEN_PATTERNS = ("v1", "v2")


class ConfigProblems(ConfigError):
    """Several problems of one command line or config, reported together (still one line)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        text = problems[0] if len(problems) == 1 else f"{len(problems)} problems: " + " ".join(
            f"({i}) {p}" for i, p in enumerate(problems, 1))
        super().__init__(text)


def need(cond, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _values(section) -> dict:
    return {f.name: copy.copy(getattr(section, f.name)) for f in dataclasses.fields(section)}


def _freeze(section, given: dict) -> None:
    section._freeze({k: v for k, v in given.items() if getattr(section, k) != v})


# ---- the sections ------------------------------------------------------------------------------
def validate_model(m: ModelConfig) -> None:
    """Checks of the model's shape; fills Megatron's derived defaults."""
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
    need(m.position_embedding_type in ("learned_absolute", "rope", "yarn", "none"),
         f"--position-embedding-type must be learned_absolute, rope, yarn or none (got {m.position_embedding_type})")
    if m.position_embedding_type == "learned_absolute":
        need(m.seq_length <= m.max_position_embeddings,
             f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_position_embeddings}; "
             "raise --max-position-embeddings")
    need(m.normalization in ("LayerNorm", "RMSNorm"),
         f"--normalization must be LayerNorm or RMSNorm (got {m.normalization})")
    validate_mla(m, need)
    validate_mup(m)
    validate_moe(m)
    validate_attention_variants(m)
    validate_variants(m)


MOE_CHOICES = {"moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
               "moe_router_score_function": ("softmax", "sigmoid"), "moe_router_dtype": (None, "fp32", "fp64"),
               "moe_token_drop_policy": ("probs", "position"),
               "moe_token_dispatcher_type": ("alltoall", "allgather", "flex")}


def validate_moe(m: ModelConfig) -> None:
    """The mixture-of-experts flags (only checked with --num-experts); fills --moe-ffn-hidden-size."""
    if m.num_experts is None:
        given = changed_flags(m, prefix="moe_")
        need(not given, f"{given[0] if given else ''} has no effect without --num-experts; set --num-experts "
             "or remove the flag")
        return
    from ..model.spec import parse_moe_layer_freq  # the flag's parser lives with the layer specs
    need(1 <= m.moe_router_topk <= m.num_experts,
         f"--moe-router-topk {m.moe_router_topk} must be between 1 and --num-experts {m.num_experts}")
    for name, choices in MOE_CHOICES.items():
        value = getattr(m, name)
        need(value in choices, f"{flag(name)} {value}: choose one of {', '.join(str(c) for c in choices)}")
    need(not m.moe_pad_expert_input_to_capacity or m.moe_expert_capacity_factor is not None,
         "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    parse_moe_layer_freq(m.moe_layer_freq, m.num_layers)
    from .validate_route import validate_routing  # the routing flags of issue 19
    validate_routing(m)


def resolve_model(m: ModelConfig) -> ModelConfig:
    """A model config on its own (GPTModel, HF conversion): validated, derived values filled, frozen."""
    given = _values(m)
    check_ranges(m)
    validate_model(m)
    _freeze(m, given)
    return m


def validate_experts(par: ParallelConfig, m: ModelConfig) -> None:
    """Expert-parallel sizes against the MoE flags; --expert-tensor-parallel-size defaults to TP (as
    Megatron). Whether EP x expert-TP divides the world is checked with the world size."""
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size
    if m.num_experts is None:
        for name, size in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
            need(size is None or size <= 1, f"{flag(name)} {size} has no effect without --num-experts; set "
                 "--num-experts or remove the flag")
        return
    need(m.num_experts % ep == 0, f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size "
         f"{ep}; change one of them")
    if etp is None:
        etp = par.expert_tensor_parallel_size = par.tensor_model_parallel_size
    need(etp >= 1, f"--expert-tensor-parallel-size must be >= 1 (got {etp})")
    need(m.moe_ffn_hidden_size % etp == 0, f"--moe-ffn-hidden-size {m.moe_ffn_hidden_size} is not divisible by "
         f"--expert-tensor-parallel-size {etp}")


def validate_parallel(par: ParallelConfig, m: ModelConfig, tr: TrainConfig) -> None:
    """Parallel sizes against the model; the pipeline layout (derives the virtual size)."""
    validate_context_parallel(par, m)
    validate_experts(par, m)
    tp = par.tensor_model_parallel_size
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        size = getattr(m, name)
        need(size % tp == 0, f"{flag(name)} {size} is not divisible by --tensor-model-parallel-size {tp}"
             + ("; use more query groups or a smaller tensor-parallel size" if name == "num_query_groups" else ""))
    if par.sequence_parallel and tp == 1:
        par.sequence_parallel = False  # Megatron does the same: SP needs TP > 1
    if par.sequence_parallel or (m.num_experts is not None and tp > 1):  # MoE splits the sequence over TP
        need(m.seq_length % tp == 0,
             f"--sequence-parallel needs --seq-length {m.seq_length} divisible by --tensor-model-parallel-size {tp}")
    from ..parallel.stages import finalize_pipeline  # imported here: parallel/ imports this package
    par.virtual_pipeline_model_parallel_size = finalize_pipeline(par, m.num_layers)
    need(par.microbatch_group_size_per_virtual_pipeline_stage is None or (par.virtual_pipeline_model_parallel_size or 1)
         > 1, "--microbatch-group-size-per-virtual-pipeline-stage needs virtual pipeline stages; remove it or add them")
    need(not par.overlap_param_gather or par.use_distributed_optimizer,
         "--overlap-param-gather needs --use-distributed-optimizer")
    need(not par.grad_reduce_in_bf16 or tr.bf16, "--grad-reduce-in-bf16 needs --bf16")
    need(not (par.grad_reduce_in_bf16 and par.accumulate_allreduce_grads_in_fp32),
         "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are mutually exclusive; choose one")


def whole_numbers(values: list, flag: str) -> list[int]:
    """A list flag's words (argparse keeps them as strings) as the non-negative ints they must be."""
    need(all(str(v).isdigit() for v in values), f"{flag} takes whole numbers (got {' '.join(map(str, values))})")
    return [int(v) for v in values]


def validate_context_parallel(par: ParallelConfig, m: ModelConfig) -> None:
    """--context-parallel-size and --cp-comm-type against the model (paratron/parallel/context.py)."""
    from ..parallel.context import COMM_TYPES
    cp, tp, kind = par.context_parallel_size, par.tensor_model_parallel_size, par.cp_comm_type
    hier, kinds = par.hierarchical_context_parallel_sizes, kind.split()
    need(len(kinds) in (1, m.num_layers), f"--cp-comm-type {kind}: give one type, or one per layer "
         f"({m.num_layers} for --num-layers {m.num_layers}; got {len(kinds)})")
    need(set(kinds) <= set(COMM_TYPES), f"--cp-comm-type must be p2p, a2a, allgather or a2a+p2p (got {kind})")
    need("a2a+p2p" not in kinds or hier is not None, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-"
         "sizes A P (the all-to-all and the ring level, A x P = --context-parallel-size)")
    need(hier is None or "a2a+p2p" in kinds, "--hierarchical-context-parallel-sizes has no effect without "
         "--cp-comm-type a2a+p2p; add it or remove the sizes")
    if hier is not None:
        hier = par.hierarchical_context_parallel_sizes = whole_numbers(hier, "--hierarchical-context-parallel-sizes")
        need(len(hier) == 2 and min(hier) >= 1 and hier[0] * hier[1] == cp,
             f"--hierarchical-context-parallel-sizes {' '.join(map(str, hier))}: give two sizes (the all-to-all and "
             f"the ring level) whose product is --context-parallel-size {cp}")
    if cp == 1:
        return
    need(m.seq_length % (2 * cp) == 0, f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size"
         f" {cp} = {2 * cp} (each CP rank holds 2 of 2 x CP equal chunks); change one of them")
    need(not par.sequence_parallel or (m.seq_length // cp) % tp == 0,
         f"--sequence-parallel with --context-parallel-size {cp} needs --seq-length / CP = {m.seq_length // cp} "
         f"divisible by --tensor-model-parallel-size {tp}")
    heads = m.num_attention_heads // tp
    need("a2a" not in kinds or heads % cp == 0, f"--cp-comm-type a2a needs the attention heads per tensor-parallel rank "
         f"({heads}) divisible by --context-parallel-size {cp}; use --cp-comm-type p2p")
    if "a2a+p2p" in kinds:
        need(heads % hier[0] == 0, f"--cp-comm-type a2a+p2p needs the attention heads per tensor-parallel rank "
             f"({heads}) divisible by the all-to-all size {hier[0]}; use a smaller one")
    need(m.attention_dropout == 0.0, f"--attention-dropout {m.attention_dropout} with --context-parallel-size {cp}: "
         "attention dropout across CP ranks is not implemented; use --attention-dropout 0")


def validate_train(tr: TrainConfig) -> None:
    need(not (tr.bf16 and tr.fp16), "--bf16 and --fp16 are mutually exclusive; choose one")
    need(tr.train_iters is None or tr.train_samples is None,
         "--train-iters and --train-samples are mutually exclusive; choose one")
    need(tr.train_iters is not None or tr.train_samples is not None,
         "set the length of training with --train-iters N or --train-samples N")
    if tr.recompute_activations:
        tr.recompute_granularity = "selective"
    need(tr.recompute_granularity in (None, "full", "selective"),
         "--recompute-granularity must be full or selective")
    if tr.recompute_granularity == "full":
        need(tr.recompute_method in ("uniform", "block"),
             "--recompute-granularity full needs --recompute-method uniform|block")
    need(tr.device in (None, "cuda", "cpu"), f"--device must be cuda or cpu (got {tr.device})")
    need(tr.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0 (got {tr.manual_gc_interval})")
    need(tr.empty_unused_memory_level in (0, 1, 2),
         f"--empty-unused-memory-level must be 0, 1 or 2 (got {tr.empty_unused_memory_level})")
    need(tr.check_for_spiky_loss or not tr.exit_on_spiky_loss, "--exit-on-spiky-loss needs --check-for-spiky-loss")
    validate_rampup(tr)


def validate_fp8(cfg: Config) -> None:
    """--fp8-*: values, --bf16, layer sizes that FP8 GEMMs take (multiples of 16), and the device."""
    tr, m, par = cfg.train, cfg.model, cfg.parallel
    if tr.fp8_hybrid:
        need(tr.fp8_format in (None, "hybrid"), f"--fp8-hybrid contradicts --fp8-format {tr.fp8_format}; choose one")
        tr.fp8_format = "hybrid"
    if tr.first_last_layers_bf16:
        start, end = tr.num_layers_at_start_in_bf16, tr.num_layers_at_end_in_bf16
        need(tr.fp8_format is not None, "--first-last-layers-bf16 has no effect without --fp8-format; add it or "
             "remove the flag")
        need(start + end <= m.num_layers, f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 "
             f"{end} must together be at most --num-layers {m.num_layers}")
    need(tr.fp8_format is not None or not tr.no_fp8_wgrad, "--no-fp8-wgrad has no effect without --fp8-format; add it "
         "or remove the flag")
    if tr.fp8_format is None:
        return
    from .. import fp8
    need(tr.fp8_format in fp8.FORMATS, f"--fp8-format must be e4m3 or hybrid (got {tr.fp8_format})")
    need(tr.fp8_recipe not in fp8.REFUSED_RECIPES,
         f"--fp8-recipe {tr.fp8_recipe} is not supported: {fp8.REFUSED_RECIPES.get(tr.fp8_recipe)}; "
         "use tensorwise or delayed")
    need(tr.fp8_recipe in fp8.RECIPES, f"--fp8-recipe must be tensorwise or delayed (got {tr.fp8_recipe})")
    need(tr.fp8_amax_compute_algo in fp8.AMAX_ALGOS,
         f"--fp8-amax-compute-algo must be max or most_recent (got {tr.fp8_amax_compute_algo})")
    need(tr.bf16, "--fp8-format needs --bf16 (FP8 matmuls with bf16 weights and activations)")
    need(not (tr.fp8_recipe == "delayed" and tr.recompute_granularity == "full"),
         "--fp8-recipe delayed with --recompute-granularity full would record each amax twice and recompute "
         "with other scales; use --fp8-recipe tensorwise or selective recomputation")
    tp, width = par.tensor_model_parallel_size, m.ffn_hidden_size * (2 if m.swiglu or m.quick_geglu else 1)
    heads = m.num_attention_heads * (2 if m.attention_output_gate else 1)
    sizes = {"--hidden-size": m.hidden_size, "QKV output per TP rank": (heads + 2 * m.num_query_groups)
             * m.kv_channels // tp, "attention width per TP rank": m.num_attention_heads * m.kv_channels // tp,
             "fc1 output per TP rank": width // tp, "--ffn-hidden-size per TP rank": m.ffn_hidden_size // tp,
             "tokens per micro-batch (--micro-batch-size x --seq-length / CP)":
                 tr.micro_batch_size * m.seq_length // par.context_parallel_size}
    for name, size in sizes.items():
        need(size % 16 == 0, f"--fp8-format needs FP8 GEMM sizes that are multiples of 16; {name} is {size}")
    problem = fp8.device_problem("cpu" if tr.device == "cpu" else "cuda")
    need(problem is None, problem)


def validate_optim(op) -> None:
    need(op.lr is not None, "set the learning rate with --lr (e.g. --lr 3e-4)")
    need(op.lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
         f"--lr-decay-style must be one of constant, linear, cosine, inverse-square-root, WSD "
         f"(got {op.lr_decay_style})")
    need(op.lr_wsd_decay_style in ("linear", "cosine", "exponential", "minus_sqrt"),
         "--lr-wsd-decay-style must be linear, cosine, exponential or minus_sqrt")
    if op.lr_warmup_fraction is not None:
        need(op.lr_warmup_iters == 0, "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
    need(op.min_lr <= op.lr, f"--min-lr {op.min_lr} is larger than --lr {op.lr}")
    need(not (op.override_opt_param_scheduler and op.use_checkpoint_opt_param_scheduler),
         "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive; choose one")


def validate_ckpt(c) -> None:
    need(c.ckpt_format in ("torch_dist", "torch_dcp"),
         f"--ckpt-format {c.ckpt_format} is not supported; paratron saves sharded torch.distributed.checkpoint "
         "checkpoints (--ckpt-format torch_dist)")
    need(not c.async_save or c.save is not None, "--async-save needs --save DIR")
    from ..checkpoint.strictness import STRICTNESS
    need(c.dist_ckpt_strictness in STRICTNESS,
         f"--dist-ckpt-strictness {c.dist_ckpt_strictness}: choose one of {', '.join(STRICTNESS)}")
    need(not c.use_checkpoint_args or c.load is not None, "--use-checkpoint-args needs --load DIR")


def validate_log(lg) -> None:
    need(lg.timing_log_level in (0, 1, 2), f"--timing-log-level must be 0, 1 or 2 (got {lg.timing_log_level})")
    need(lg.timing_log_option in ("max", "minmax", "all"),
         f"--timing-log-option must be max, minmax or all (got {lg.timing_log_option})")
    if lg.wandb_project is not None:
        import importlib.util
        need(importlib.util.find_spec("wandb") is not None,
             "--wandb-project needs the wandb package: pip install 'paratron[wandb]' (or pip install wandb)")
    need(lg.sample_prompt != "", "--sample-prompt: the prompt is empty; give some text")
    if lg.profile_ranks is not None:
        lg.profile_ranks = whole_numbers(lg.profile_ranks, "--profile-ranks")


def validate_sample(cfg) -> None:
    """--sample-prompt generates with the whole model on each rank, without sequence or context parallelism."""
    if cfg.log.sample_prompt is None:
        return
    par = cfg.parallel
    need(par.pipeline_model_parallel_size == 1, "--sample-prompt needs the whole model on each rank: "
         "it cannot sample with --pipeline-model-parallel-size > 1 (sample with `paratron generate` instead)")
    need(not par.sequence_parallel and par.context_parallel_size == 1,
         "--sample-prompt cannot sample with --sequence-parallel or --context-parallel-size > 1; drop one of them "
         "(or sample the checkpoint with `paratron generate`)")


def validate_tokenizer(d: DataConfig) -> None:
    """The tokenizer flags (shared by train and preprocess)."""
    from ..data.tokenizers import TOKENIZER_TYPES
    check_ranges(d)
    need(d.tokenizer_type is not None, "set the tokenizer with --tokenizer-type (and its files); see docs/data.md")
    if d.tokenizer_type not in TOKENIZER_TYPES:
        close = ([t for t in TOKENIZER_TYPES if t.lower().startswith(d.tokenizer_type.lower())]
                 or difflib.get_close_matches(d.tokenizer_type, TOKENIZER_TYPES, n=1))
        hint = f"did you mean {close[0]}?" if close else f"choose one of {', '.join(TOKENIZER_TYPES)}"
        raise ConfigError(f"--tokenizer-type {d.tokenizer_type} is not supported; {hint}")
    if d.tokenizer_type == "NullTokenizer":
        need(d.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size N")
    need(d.tiktoken_pattern in TIKTOKEN_PATTERNS, f"--tiktoken-pattern must be v1 or v2 (got {d.tiktoken_pattern})")


def validate_data(d: DataConfig) -> None:
    have_data = d.mock_data or d.data_path or d.train_data_path
    need(bool(have_data), "no training data: pass --data-path PREFIX (or --train-data-path) or --mock-data")
    need(not (d.mock_data and (d.data_path or d.train_data_path)),
         "--mock-data and --data-path are mutually exclusive; choose one")
    if d.tokenizer_type is None and (d.vocab_file or d.merge_file):
        d.tokenizer_type = "GPT2BPETokenizer"  # Megatron's default tokenizer (pretrain_gpt.py)
    need(d.tokenizer_type in (None, "GPT2BPETokenizer") or not (d.vocab_file or d.merge_file),
         f"--vocab-file/--merge-file are read only by GPT2BPETokenizer, not --tokenizer-type {d.tokenizer_type}; "
         "remove them or use --tokenizer-type GPT2BPETokenizer")
    if d.tokenizer_type is None and d.mock_data:
        # No tokenizer flags with mock data: a NullTokenizer over the GPT-2 vocabulary size (its EOD,
        # vocab_size - 1 = 50256, is GPT-2's end-of-text id).
        d.tokenizer_type = "NullTokenizer"
        d.vocab_size = d.vocab_size or 50257
    validate_tokenizer(d)


# ---- values that need the world size or the tokenizer ------------------------------------------
def world_size_default() -> int:
    """torch.distributed's world size when it is initialised, else torchrun's WORLD_SIZE, else 1."""
    dist = sys.modules.get("torch.distributed")  # never imported just for this
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_batch(cfg: Config, data_parallel_size: int) -> None:
    """Check that the global batch (and a ramp's sizes) split into micro-batches over ``data_parallel_size``
    data-parallel ranks. Writes nothing."""
    tr = cfg.train
    per_step = tr.micro_batch_size * data_parallel_size
    gbs = tr.global_batch_size if tr.global_batch_size is not None else per_step
    need(gbs % per_step == 0,
         f"--global-batch-size {gbs} is not divisible by --micro-batch-size {tr.micro_batch_size} x "
         f"data-parallel size {data_parallel_size}; adjust one of them")
    schedule_batches(cfg, data_parallel_size)
    if tr.rampup_batch_size is not None:
        start, inc, _ = tr.rampup_batch_size
        need(start % per_step == 0 and inc % per_step == 0,
             f"--rampup-batch-size START {start} and INCREMENT {inc} must be multiples of --micro-batch-size "
             f"{tr.micro_batch_size} x data-parallel size {data_parallel_size}")


def resolve_world(cfg: Config, world: int) -> None:
    """The data-parallel size of ``world`` processes; the global batch default; --train-iters of --train-samples."""
    from ..train.microbatches import MicroBatches
    par, tr = cfg.parallel, cfg.train
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    need(world >= 1 and world % (tp * pp * cp) == 0,
         f"world size {world} is not divisible by TP {tp} x PP {pp} x CP {cp} = {tp * pp * cp}; "
         "change the parallel sizes or the number of processes")
    dp = world // (tp * pp * cp)
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size or tp
    need((world // pp) % (ep * etp) == 0,
         f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does not divide the {world // pp} "
         f"ranks of a pipeline stage (world size {world} / PP {pp}); change the expert-parallel sizes")
    check_mapping(par, world)
    resolve_batch(cfg, dp)
    if tr.global_batch_size is None:
        tr.global_batch_size = tr.micro_batch_size * dp
    if tr.train_iters is None:
        micro = MicroBatches(tr.global_batch_size, tr.micro_batch_size, dp, tr.rampup_batch_size, schedule_of(cfg))
        tr.train_iters = micro.train_iters_for_samples(tr.train_samples)
    cfg.world_size = world


def _set_vocab(cfg: Config, vocab_size) -> None:
    cfg.data.vocab_size = vocab_size(cfg.data)
    padded, tp = cfg.data.padded_vocab_size, cfg.parallel.tensor_model_parallel_size
    if padded is not None:  # --padded-vocab-size: the model's rows as given, checked against the tokenizer and TP
        need(padded >= cfg.data.vocab_size and padded % tp == 0, f"--padded-vocab-size {padded} must be at least the "
             f"tokenizer's {cfg.data.vocab_size} tokens and divisible by --tensor-model-parallel-size {tp}")


def _run_all(steps) -> None:
    """Run every validation step; report the problem of each step together (ConfigProblems). An
    error that follows an earlier problem (a value the failed step did not derive) is not reported."""
    from ..errors import UserError
    errors = []
    for step in steps:
        try:
            step()
        except UserError as e:
            errors.append(e)
        except Exception:
            if not errors:
                raise
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigProblems([p for e in errors for p in (e.problems if isinstance(e, ConfigProblems) else [str(e)])])


def _validate_routing_parallel(cfg: Config) -> None:
    from .validate_route import validate_routing_parallel
    validate_routing_parallel(cfg.parallel, cfg.model, cfg.log)


def _validate_mtp(cfg: Config) -> None:
    from .validate_mtp import validate_mtp
    validate_mtp(cfg)


def resolve(cfg: Config, world_size: Optional[int] = None) -> Config:
    """Validate ``cfg`` section by section, compute every derived value, and freeze it (in place; also
    returned). ``world_size``: the number of processes of the run (default: ``cfg.world_size`` if set,
    else :func:`world_size_default`). Raises ConfigError (or DataError for tokenizer files) with one
    line; on an error ``cfg`` is left as it was given. A resolved config is returned as it is."""
    if cfg.is_resolved:
        need(world_size is None or world_size == cfg.world_size,
             f"the config was resolved for world size {cfg.world_size}, not {world_size}; resolve a copy: "
             f"resolve(cfg.unfrozen(), world_size={world_size})")
        return cfg
    from ..data.tokenizers import tokenizer_vocab_size
    world = world_size or cfg.world_size or world_size_default()
    given = {name: _values(getattr(cfg, name)) for name in SECTIONS}
    given_world = cfg.world_size
    steps = (lambda: validate_optimizer(cfg), lambda: validate_run_variants(cfg), lambda: validate_model(cfg.model),
             lambda: validate_parallel(cfg.parallel, cfg.model, cfg.train),
             lambda: validate_train(cfg.train), lambda: validate_fp8(cfg), lambda: validate_optim(cfg.optim),
             lambda: validate_ckpt(cfg.ckpt), lambda: validate_log(cfg.log), lambda: validate_data(cfg.data),
             lambda: validate_sched(cfg), lambda: _validate_routing_parallel(cfg),
             lambda: _validate_mtp(cfg), lambda: check_kernels(cfg.kernels))
    try:
        _run_all([lambda name=name: check_ranges(getattr(cfg, name)) for name in SECTIONS])  # numbers first
        _run_all(steps)  # each section's problem, together
        validate_sample(cfg)
        resolve_world(cfg, world)  # these need every section valid
        _set_vocab(cfg, tokenizer_vocab_size)
    except Exception:
        for name, values in given.items():
            for key, value in values.items():
                setattr(getattr(cfg, name), key, value)
        cfg.world_size = given_world
        raise
    for name in SECTIONS:
        _freeze(getattr(cfg, name), given[name])
    cfg._freeze({})
    return cfg


finalize = resolve  # the former name


def check_resolved(cfg: Config, world_size: int) -> None:
    """What a run needs of its config: resolved, for this many processes."""
    need(cfg.is_resolved, "the config is not resolved: call paratron.config.resolve(cfg) (parse_args does) first")
    need(cfg.world_size == world_size,
         f"the config was resolved for world size {cfg.world_size} but this run has {world_size} processes; "
         f"resolve it with resolve(cfg, world_size={world_size})")

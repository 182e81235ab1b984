"""Checks of the parallel section against the model: tensor / sequence / context / expert parallel sizes,
the pipeline layout (which derives the virtual size), the rank order, and what sampling during training
needs. The sizes against the number of processes are checked in resolve.py (resolve_world)."""
from __future__ import annotations

from .check_hybrid import validate_hybrid_parallel
from .check_moe import validate_experts
from .pipeline_split import finalize_pipeline
from .rules import need, whole_numbers
from .sections import ModelConfig, ParallelConfig, TrainConfig, flag
from .values import COMM_TYPES, SHARDING_STRATEGIES


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
    validate_hybrid_parallel(par, m)  # (a pattern's '|' stages become the pipeline layout)
    par.virtual_pipeline_model_parallel_size = finalize_pipeline(par, m.num_layers)
    need(par.microbatch_group_size_per_virtual_pipeline_stage is None or (par.virtual_pipeline_model_parallel_size or 1)
         > 1, "--microbatch-group-size-per-virtual-pipeline-stage needs virtual pipeline stages; remove it or add them")
    validate_sharding(par, tr)
    need(not par.overlap_param_gather or par.use_distributed_optimizer,
         "--overlap-param-gather needs --use-distributed-optimizer")
    need(not par.grad_reduce_in_bf16 or tr.bf16, "--grad-reduce-in-bf16 needs --bf16")
    need(not (par.grad_reduce_in_bf16 and par.accumulate_allreduce_grads_in_fp32),
         "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are mutually exclusive; choose one")
    need(par.ddp_num_buckets is None or par.ddp_bucket_size is None,
         "--ddp-num-buckets and --ddp-bucket-size both size the gradient buckets (as in Megatron): give one")


def validate_sharding(par: ParallelConfig, tr: TrainConfig) -> None:
    """--use-megatron-fsdp, --data-parallel-sharding-strategy and --fp8-param-gather. A strategy that shards
    anything turns the distributed optimizer on (it owns the shards)."""
    kind = par.data_parallel_sharding_strategy
    need(kind in SHARDING_STRATEGIES, f"--data-parallel-sharding-strategy must be one of "
         f"{', '.join(SHARDING_STRATEGIES)} (got {kind})")
    need(par.use_megatron_fsdp or kind == "no_shard", f"--data-parallel-sharding-strategy {kind} has no effect "
         "without --use-megatron-fsdp; add it (or use --use-distributed-optimizer alone for optim)")
    if par.use_megatron_fsdp:
        need(kind != "no_shard" or not par.use_distributed_optimizer, "--data-parallel-sharding-strategy no_shard "
             "contradicts --use-distributed-optimizer (which shards the optimizer state: strategy optim); choose one")
        par.use_distributed_optimizer = kind != "no_shard"
    zero3 = kind == "optim_grads_params" and par.use_megatron_fsdp
    need(not (zero3 and tr.check_weight_hash_across_dp_replicas_interval),
         "--check-weight-hash-across-dp-replicas-interval with --data-parallel-sharding-strategy optim_grads_params: "
         "the data-parallel ranks hold different shards, not replicas; remove the interval")
    if par.fp8_param_gather:
        need(tr.fp8_format is not None or tr.fp8_hybrid, "--fp8-param-gather needs FP8 training (--fp8-format); "
             "remove it or add --fp8-format")
        need(par.use_distributed_optimizer, "--fp8-param-gather needs a parameter all-gather: add "
             "--use-distributed-optimizer or --use-megatron-fsdp with a sharding strategy other than no_shard")


def validate_context_parallel(par: ParallelConfig, m: ModelConfig) -> None:
    """--context-parallel-size and --cp-comm-type against the model (paratron/parallel/context.py)."""
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


def check_mapping(par, world: int) -> None:
    """--use-tp-pp-dp-mapping (DP outermost): Megatron asks the dense and expert data-parallel sizes to be
    equal when PP > 1, so that both layouts have the same pipeline groups."""
    if not par.use_tp_pp_dp_mapping:
        return
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size or tp
    need(pp == 1 or ep * etp == tp * cp,
         f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp} needs expert-TP {etp} x EP {ep} = TP {tp} "
         f"x CP {cp} (equal data-parallel sizes of the dense and expert layers)")


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

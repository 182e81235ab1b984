"""Checks of the mixture-of-experts flags: the basic MoE flags (only with --num-experts), the routing
flags of issue 19 (Sinkhorn, group-limited routing, the shared-expert gate, the flex dispatcher) with
Megatron's rules, and the expert-parallel sizes against them."""
from __future__ import annotations

from typing import Optional

from .layer_patterns import parse_moe_layer_freq
from .rules import changed_flags, need
from .sections import LogConfig, ModelConfig, ParallelConfig, flag

MOE_CHOICES = {"moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
               "moe_router_score_function": ("softmax", "sigmoid"), "moe_router_dtype": (None, "fp32", "fp64"),
               "moe_token_drop_policy": ("probs", "position"),
               "moe_token_dispatcher_type": ("alltoall", "allgather", "flex")}
FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")


def validate_moe(m: ModelConfig) -> None:
    """The mixture-of-experts flags (only checked with --num-experts); fills --moe-ffn-hidden-size."""
    if m.num_experts is None:
        given = changed_flags(m, prefix="moe_")
        need(not given, f"{given[0] if given else ''} has no effect without --num-experts; set --num-experts "
             "or remove the flag")
        return
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
    validate_routing(m)


def validate_routing(m: ModelConfig) -> None:
    """The model's routing flags (--num-experts given)."""
    if m.moe_router_load_balancing_type == "sinkhorn":
        need(m.moe_aux_loss_coeff == 0, f"--moe-router-load-balancing-type sinkhorn balances without an aux loss: "
             f"remove --moe-aux-loss-coeff {m.moe_aux_loss_coeff} (Megatron refuses it too)")
        need(m.moe_expert_capacity_factor is None, "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss "
             "or none load balancing, not sinkhorn")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if group_topk:
        need(groups, f"--moe-router-group-topk {group_topk} needs --moe-router-num-groups (the expert groups)")
        need(m.num_experts % groups == 0,
             f"--num-experts {m.num_experts} is not divisible by --moe-router-num-groups {groups}")
        need(group_topk <= groups,
             f"--moe-router-group-topk {group_topk} is more than --moe-router-num-groups {groups}")
        need(m.moe_router_topk % group_topk == 0 and m.moe_router_topk // group_topk <= m.num_experts // groups,
             f"--moe-router-topk {m.moe_router_topk} must be a multiple of --moe-router-group-topk {group_topk} with "
             f"at most {m.num_experts // groups} (the experts of a group) per group")
        need(m.moe_router_load_balancing_type != "sinkhorn",
             "--moe-router-group-topk: Sinkhorn routing ignores the groups; use another load-balancing type")
    else:
        need(groups is None, f"--moe-router-num-groups {groups} has no effect without --moe-router-group-topk; set it "
             "or remove the flag")
    if m.moe_enable_deepep:  # (Megatron's checks, then its deprecated flag's meaning)
        need(m.moe_token_dispatcher_type == "flex", "--moe-enable-deepep needs --moe-token-dispatcher-type flex (as "
             "Megatron)")
        need(m.moe_flex_dispatcher_backend != "hybridep", "--moe-enable-deepep with --moe-flex-dispatcher-backend "
             "hybridep: the flex dispatcher takes one backend; remove one")
        m.moe_flex_dispatcher_backend = "deepep"
    need(m.moe_flex_dispatcher_backend in FLEX_BACKENDS,
         f"--moe-flex-dispatcher-backend {m.moe_flex_dispatcher_backend}: choose one of {', '.join(FLEX_BACKENDS)}")
    need(m.moe_flex_dispatcher_backend != "ncclep" or m.moe_token_dispatcher_type == "flex",
         "--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex (as Megatron)")
    if m.moe_token_dispatcher_type == "flex":
        need(not (m.moe_pad_expert_input_to_capacity and m.moe_flex_dispatcher_backend == "deepep"),
             "--moe-pad-expert-input-to-capacity is not supported by the flex dispatcher's deepep backend "
             "(as Megatron); use --moe-flex-dispatcher-backend hybridep or another dispatcher")
    need(not m.moe_shared_expert_overlap or m.moe_token_dispatcher_type in ("alltoall", "flex"),
         "--moe-shared-expert-overlap computes the shared expert under the alltoall dispatch's all-to-all: use "
         "--moe-token-dispatcher-type alltoall or flex (as Megatron)")
    need(not m.moe_shared_expert_gate or m.moe_shared_expert_intermediate_size is not None,
         "--moe-shared-expert-gate gates the shared expert: set --moe-shared-expert-intermediate-size")


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


def validate_routing_parallel(par: ParallelConfig, m: ModelConfig, lg: LogConfig) -> None:
    """Routing flags against the parallel layout and the logging flags."""
    need(not lg.moe_per_layer_logging or m.num_experts is not None,
         "--moe-per-layer-logging has no effect without --num-experts; set --num-experts or remove the flag")
    if m.num_experts is None or m.moe_token_dispatcher_type != "flex":
        return
    ranks = par.expert_model_parallel_size * (par.expert_tensor_parallel_size or par.tensor_model_parallel_size)
    need(ranks > 1 or m.moe_flex_dispatcher_backend == "hybridep",
         f"--moe-token-dispatcher-type flex with backend {m.moe_flex_dispatcher_backend} needs --expert-model-parallel-"
         f"size x --expert-tensor-parallel-size > 1 (Megatron's assertion); use alltoall on one expert rank")


def validate_combined_overlap(cfg) -> None:
    """--overlap-moe-expert-parallel-comm (parallel/turns.py) with Megatron's rules, and paratron's own: not with
    ZeRO-3."""
    par, tr = cfg.parallel, cfg.train
    etp = par.expert_tensor_parallel_size or par.tensor_model_parallel_size
    check_combined_overlap(cfg.model, expert_ranks=par.expert_model_parallel_size * etp,
                           recompute_granularity=tr.recompute_granularity,
                           sharding_strategy=par.data_parallel_sharding_strategy, fp8_format=tr.fp8_format)


def check_combined_overlap(m, *, expert_ranks: Optional[int], recompute_granularity: Optional[str],
                           sharding_strategy: Optional[str], fp8_format: Optional[str] = None) -> None:
    """The rules of --overlap-moe-expert-parallel-comm and --delay-wgrad-compute for the model config ``m`` and
    what the run around it chose; a value None is not known yet and not checked (the Megatron Core facade knows
    the expert ranks when it builds a model and the sharding when it wraps it: it checks at each)."""
    if m.delay_wgrad_compute:
        need(m.overlap_moe_expert_parallel_comm, "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (as "
             "Megatron): the experts' weight gradients are computed under its dispatch's backward all-to-all")
        _defers_expert_wgrads(m, "--delay-wgrad-compute", fp8_format)
    if m.overlap_dispatch_backward_with_experts_wgrad:
        check_dispatch_backward_overlap(m, expert_ranks, fp8_format)
    if not m.overlap_moe_expert_parallel_comm:
        return
    name = "--overlap-moe-expert-parallel-comm"
    _overlaps_the_all_to_alls(m, name, expert_ranks, "overlap the same all-to-all")
    need((m.mtp_num_layers or 0) <= 1, f"{name} supports at most one MTP layer (as Megatron); got "
         f"--mtp-num-layers {m.mtp_num_layers}")
    need(recompute_granularity != "full", f"{name} is not supported with --recompute-granularity full (as "
         "Megatron); use selective recomputation or none")
    need(sharding_strategy != "optim_grads_params", f"{name} is not supported with "
         "--data-parallel-sharding-strategy optim_grads_params: ZeRO-3 gathers and frees each layer's parameters for "
         "one pass at a time, and the turns run two; use optim_grads (ZeRO-2) or remove the flag")


def check_dispatch_backward_overlap(m, expert_ranks: Optional[int], fp8_format: Optional[str]) -> None:
    """--overlap-dispatch-backward-with-experts-wgrad: Megatron's exclusions, and what paratron's needs (the
    alltoall dispatcher's all-to-all to overlap, the grouped GEMMs whose weight gradients it defers)."""
    name = "--overlap-dispatch-backward-with-experts-wgrad"
    need(not m.delay_wgrad_compute and not m.overlap_moe_expert_parallel_comm, f"{name} and --delay-wgrad-compute / "
         "--overlap-moe-expert-parallel-comm defer the same weight gradients (as Megatron, they exclude each other): "
         "remove one")
    _overlaps_the_all_to_alls(m, name, expert_ranks, "both work under the dispatch's backward all-to-all")
    _defers_expert_wgrads(m, name, fp8_format)


def _overlaps_the_all_to_alls(m, name: str, expert_ranks: Optional[int], shared_overlap: str) -> None:
    """What an overlap of the alltoall dispatcher's all-to-alls needs (as Megatron's): experts, more than one expert
    rank, that dispatcher, and not --moe-shared-expert-overlap (``shared_overlap``: why not)."""
    need(m.num_experts is not None, f"{name} overlaps the expert all-to-alls: set --num-experts or remove the flag")
    need(expert_ranks is None or expert_ranks > 1, f"{name} needs --expert-model-parallel-size > 1 (x "
         "--expert-tensor-parallel-size: the experts on one rank move no rows, as Megatron requires); remove the flag")
    need(m.moe_token_dispatcher_type in ("alltoall", "flex"), f"{name} overlaps the alltoall dispatcher's "
         "all-to-alls: use --moe-token-dispatcher-type alltoall or flex (as Megatron)")
    need(not m.moe_shared_expert_overlap, f"{name} and --moe-shared-expert-overlap {shared_overlap}: remove one")


def _defers_expert_wgrads(m, name: str, fp8_format: Optional[str]) -> None:
    """What deferring the experts' weight gradients needs: the grouped GEMMs that owe them, not FP8 experts."""
    need(m.moe_grouped_gemm, f"{name} defers the experts' grouped GEMMs' weight gradients: set --moe-grouped-gemm")
    need(fp8_format is None, f"{name} is not built for FP8 experts (their weight gradients stay in the backward); "
         "remove one")

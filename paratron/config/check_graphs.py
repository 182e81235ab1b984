"""Checks of --cuda-graph-impl / --cuda-graph-scope / --cuda-graph-warmup-steps (paratron/train/step_graph.py):
Megatron's values, and the runs whose step a CUDA graph cannot hold yet, refused by name with the reason."""
from __future__ import annotations

from .rules import need
from .values import sharding_level

SCOPE = "full_iteration"
LOCAL = "--cuda-graph-impl local"


def validate_graphs(cfg) -> None:
    tr = cfg.train
    scope = list(tr.cuda_graph_scope or [])
    need(tr.cuda_graph_impl in ("none", "local", "transformer_engine"),
         f"--cuda-graph-impl {tr.cuda_graph_impl}: choose none or local")
    need(tr.cuda_graph_impl != "transformer_engine", "--cuda-graph-impl transformer_engine: paratron does not use "
         f"Transformer Engine; {LOCAL} --cuda-graph-scope {SCOPE} captures the step with torch.cuda.graph")
    if tr.cuda_graph_impl == "none":
        need(not scope, f"--cuda-graph-scope has no effect without {LOCAL}; add it or remove the scope")
        return
    need(scope == [SCOPE], f"{LOCAL} captures the whole forward-backward step only: add --cuda-graph-scope {SCOPE} "
         f"(per-module graphs, --cuda-graph-scope {' '.join(scope) or 'attn mlp ...'}, are not built)")
    need(tr.device != "cpu", f"{LOCAL}: CUDA graphs need a GPU; this run is on the CPU (--device cpu)")
    _not_with(cfg)


def _not_with(cfg) -> None:
    """What a captured step cannot do yet: each refused by its flag."""
    tr, p, m = cfg.train, cfg.parallel, cfg.model
    split = ((p.tensor_model_parallel_size, "--tensor-model-parallel-size", "the tensor-parallel RNG fork swaps "
              "generator states on the host"),
             (p.pipeline_model_parallel_size, "--pipeline-model-parallel-size", "the pipeline schedule's "
              "transfers are timed by the host"),
             (p.context_parallel_size, "--context-parallel-size", "not captured yet"),
             (p.expert_model_parallel_size, "--expert-model-parallel-size", "the expert all-to-all's split sizes are "
              "read on the host"),
             (p.expert_tensor_parallel_size or 1, "--expert-tensor-parallel-size", "the same all-to-all"))
    for size, flag, why in split:
        need(size == 1, f"{LOCAL} with {flag} {size}: {why}; CUDA graphs run one model-parallel rank per data-parallel "
             "replica (data parallelism is fine)")
    flags = ((p.overlap_grad_reduce, "--overlap-grad-reduce", "its reductions are launched by backward hooks that "
              "count gradients on the host"),
             (p.overlap_param_gather, "--overlap-param-gather", "its gathers are launched by forward hooks"),
             (sharding_level(p) >= 2, f"--data-parallel-sharding-strategy {p.data_parallel_sharding_strategy}",
              "the gradient buckets get their memory during the step (ZeRO-2/3)"),
             (tr.fine_grained_activation_offloading, "--fine-grained-activation-offloading",
              "its copies between host and device are ordered by the host mid-step"),
             (m.moe_router_force_load_balancing, "--moe-router-force-load-balancing",
              "it draws from the expert-parallel generator the graph does not own"),
             (m.num_experts and not m.moe_grouped_gemm and tr.fp8_format is None,
              "--num-experts without --moe-grouped-gemm", "the experts' loop of one matmul per expert reads each "
              "expert's row count on the host (add --moe-grouped-gemm)"),
             (m.num_experts and m.moe_expert_capacity_factor is not None and not m.moe_pad_expert_input_to_capacity,
              "--moe-expert-capacity-factor", "dropping tokens over capacity picks the kept ones on the host (add "
              "--moe-pad-expert-input-to-capacity, or route without a capacity)"))
    for on, flag, why in flags:
        need(not on, f"{LOCAL} with {flag}: {why}; remove one")

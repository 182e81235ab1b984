"""``paratron plan``: the layouts of a model on a cluster that fit in memory, ranked by predicted tokens/s,
each with its memory and time broken down and the command line that runs it.

    paratron plan --config llama-1b --gpus 8 --gpu h100 --global-batch-size 64 --seq-length 2048

The model, global batch and sequence length are Megatron's flags (or a preset / YAML by --config); the
cluster is the plan's own flags below. The parallel flags of the model's config are the layout it also
reports ("as given"); the search varies them."""
from __future__ import annotations

import argparse
from typing import Optional

from ..config import Config, parse_args
from ..config.check_hybrid import is_hybrid_stack
from ..errors import ConfigError, UserError
from .cost import GPUS, MATMUL_EFFICIENCY, Cluster, StepTime
from .layout import layout_of
from .memory import ALLOCATOR_SLACK, GIB, Memory, describe, not_modelled
from .search import Candidate, planned, search

# The flags a plan's command line sets itself (the user's values for them are replaced).
SET_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--virtual-pipeline-model-parallel-size",
             "--context-parallel-size", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
             "--micro-batch-size", "--sequence-parallel", "--use-distributed-optimizer", "--recompute-granularity",
             "--recompute-method", "--recompute-num-layers", "--data-parallel-sharding-strategy",
             "--optimizer-cpu-offload", "--optimizer-offload-fraction", "--overlap-grad-reduce",
             "--overlap-param-gather", "--recompute-activations", "--use-megatron-fsdp")


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratron plan", add_help=False,
                                description="rank the layouts that fit; other flags describe the model (Megatron's)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the cluster")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(GPUS)}")
    p.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: the kind's)")
    p.add_argument("--intra-node-gbps", type=float, help="GB/s per GPU inside a node (default: the kind's NVLink)")
    p.add_argument("--inter-node-gbps", type=float, help="GB/s per GPU across nodes (default: the kind's network)")
    p.add_argument("--matmul-efficiency", type=float, default=MATMUL_EFFICIENCY,
                   help="fraction of the dense peak the matmuls reach (an assumption: measure yours)")
    p.add_argument("--host-gbps", type=float, default=None,
                   help="host <-> GPU GB/s each way, optimizer and activation offload (default: the kind's)")
    p.add_argument("--fp8", action="store_true", help="plan FP8 matmuls (--fp8-format) on Hopper")
    p.add_argument("--top", type=int, default=10, help="layouts listed")
    p.add_argument("--explain", type=int, default=None,
                   help="layouts given with their memory and time by part and their command (default: all listed)")
    return p


def model_config(rest: list[str], gpus: int, fallback: bool = True) -> tuple[Config, bool]:
    """The model's config from the remaining flags, resolved for the cluster (a run length and learning rate
    are filled in when missing: the plan does not train), and whether its own layout runs there (else it is
    resolved with the parallel flags and micro-batch the plan varies left out)."""
    extra = [] if any(a in rest for a in ("--train-iters", "--train-samples")) else ["--train-iters", "1"]
    extra += [] if "--lr" in rest else ["--lr", "1e-4"]
    try:
        return parse_args(rest + extra, world_size=gpus), True
    except UserError:
        if not fallback:
            raise
        return parse_args(kept_flags(rest) + extra + ["--micro-batch-size", "1"], world_size=1), False


def kept_flags(rest: list[str]) -> list[str]:
    """The user's model flags without those a plan's command line sets."""
    out, skip = [], False
    for tok in rest:
        if tok.startswith("--"):
            skip = tok.split("=")[0] in SET_FLAGS
        if not skip:
            out.append(tok)
    return out


def command(c: Candidate, rest: list[str], cluster: Cluster) -> str:
    L = c.layout
    nodes = max(1, cluster.gpus // cluster.gpus_per_node)
    flags = [f"--tensor-model-parallel-size {L.tp}", f"--pipeline-model-parallel-size {L.pp}"]
    flags += [f"--virtual-pipeline-model-parallel-size {L.vpp}"] if L.vpp > 1 else []
    flags += [f"--context-parallel-size {L.cp}"] if L.cp > 1 else []
    flags += [f"--expert-model-parallel-size {L.ep}", f"--expert-tensor-parallel-size {L.etp}"] if L.ep > 1 else []
    flags += ["--sequence-parallel"] if L.sequence_parallel else []
    flags += [f"--micro-batch-size {L.micro_batch}"]
    if L.sharding == "optim":
        flags += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    elif L.sharding != "no_shard":
        flags += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {L.sharding}", "--overlap-grad-reduce",
                  "--overlap-param-gather"]
    if L.recompute == "full":
        flags += ["--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"]
    elif L.recompute == "selective":
        flags += ["--recompute-granularity selective"]
    flags += [f"--optimizer-cpu-offload --optimizer-offload-fraction {L.offload_fraction:g}"] if L.offload_fraction else []
    flags += ["--fp8-format hybrid"] if L.fp8 and "--fp8-format" not in rest else []
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {min(cluster.gpus, cluster.gpus_per_node)}"
    return f"{launch} -m paratron train {' '.join(kept_flags(rest) + flags)}"


def row(i: int, c: Candidate) -> str:
    L = c.layout
    speed = f"{c.time.total:8.3f} {c.tokens_per_s:12,.0f}" if c.time else f"{'-':>8} {'does not fit':>12}"
    return (f"{i:>3} {L.tp:>3} {L.pp:>3} {L.vpp:>3} {L.cp:>3} {L.ep:>3} {L.etp:>4} {L.dp:>4} {L.micro_batch:>3} "
            f"{L.sharding:>18} {L.recompute or 'none':>9} {L.offload_fraction:>4.1f} {c.memory.total / GIB:8.1f} {speed}")


HEADER = (f"{'#':>3} {'TP':>3} {'PP':>3} {'VPP':>3} {'CP':>3} {'EP':>3} {'ETP':>4} {'DP':>4} {'MB':>3} "
          f"{'sharding':>18} {'recompute':>9} {'offl':>4} {'mem GiB':>8} {'step s':>8} {'tokens/s':>12}")


def explain(c: Candidate, rest: list[str], cluster: Cluster) -> list[str]:
    t = c.time
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.parts().items() if v > 0)
    return [f"  memory (pipeline rank {c.memory.pp_rank}): {describe(c.memory)}"
            + (f"; host {c.memory.host / GIB:.1f} GiB" if c.memory.host else ""),
            f"  time: {parts} = {t.total * 1e3:.1f} ms ({c.layout.microbatches} micro-batches per step)",
            f"  run: {command(c, rest, cluster)}"]


def runnable(found: list[Candidate], rest: list[str], cluster: Cluster, top: int) -> tuple[list, dict]:
    """The first ``top`` fitting candidates whose command line the config accepts; {reason: count} of the
    others passed over (a combination of flags paratron refuses)."""
    out, refused = [], {}
    for c in found:
        if c.time is None or len(out) == top:
            break
        argv = command(c, rest, cluster).split(" -m paratron train ")[1].split()
        try:
            model_config(argv, cluster.gpus, fallback=False)
            out.append(c)
        except UserError as e:
            reason = str(e).splitlines()[-1][:120]
            refused[reason] = refused.get(reason, 0) + 1
    return out, refused


def report(cfg: Config, cluster: Cluster, rest: list[str], fp8: bool, top: int, n_explain: int,
           host_ops: tuple = (0, 0), traffic=None) -> list[str]:
    m, base = cfg.model, layout_of(cfg, cluster.kind, host_ops, traffic)
    found = search(m, cfg.data.vocab_size, m.make_vocab_size_divisible_by, cluster, base, fp8, cfg.data.padded_vocab_size)
    fits, refused = runnable(found, rest, cluster, top)
    lines = [f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
             f"({m.num_query_groups} query groups), ffn {m.ffn_hidden_size}"
             + (f", {m.num_experts} experts top-{m.moe_router_topk}" if m.num_experts else "")
             + f"; global batch {base.global_batch} x sequence {base.seq_length}",
             f"cluster: {cluster.gpus} x {cluster.kind or 'GPU'} ({cluster.memory / GIB:.1f} GiB each), "
             f"{cluster.gpus_per_node} per node",
             f"derivation: {len(found)} layouts considered, {sum(c.time is not None for c in found)} fit; memory = weights + gradients + optimizer"
             f" + activations + comm buffers, + {ALLOCATOR_SLACK:.0%} allocator slack (assumed); time = FLOPs at "
             f"{cluster.matmul_efficiency:.0%} of the dense peak (assumed) + memory-bound bytes at "
             f"{cluster.memory_efficiency:.0%} of the memory bandwidth (assumed) + recompute + bubble + exposed "
             "communication (docs/plan.md)"]
    if is_hybrid_stack(m):
        scans = "recomputed" if base.paths.scan_recompute else "intra-chunk products kept"
        lines.append(f"hybrid stack: parameters, activations (torch scans, {scans}), FLOPs, memory-bound bytes and "
                     "host operations counted per layer kind (docs/plan.md)")
    lines += [f"passed over {n} fitting layout(s) the config refuses: {why}" for why, n in refused.items()]
    lines += ["", HEADER]
    lines += [row(i + 1, c) for i, c in enumerate(fits[:top])]
    if not fits:
        lines += [row(i + 1, c) for i, c in enumerate(sorted(found, key=lambda c: c.memory.total)[:top])]
        lines.append("nothing fits: the smallest are listed; more GPUs, FP8 or offload may help")
    for i, c in enumerate(fits[:n_explain]):
        lines += ["", f"#{i + 1}:"] + explain(c, rest, cluster)
    return lines


def as_given(mem: Memory, t: StepTime, cluster: Cluster) -> str:
    """The config's own layout (:func:`paratron.plan.search.planned`): its memory, and its time where it fits."""
    fits = mem.total <= cluster.memory
    return f"as given: {describe(mem)}; " + (f"fits, step {t.total:.3f} s" if fits else "does NOT fit")


GRAPH_FLAGS = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
HOST_HINT_SHARE = 0.1  # the host's exposed share of the step above which the plan names the step graph


def graph_hint(t: StepTime, cluster: Cluster, rest: list[str]) -> Optional[str]:
    """A line naming the step's CUDA graph where the config's own step ``t`` waits on the host for more than
    ``HOST_HINT_SHARE`` of its time and the config (``rest``: its flags) takes the graph (the plan counts no host
    time with it)."""
    if t.host <= HOST_HINT_SHARE * t.total:
        return None
    try:
        model_config(rest + GRAPH_FLAGS, cluster.gpus, fallback=False)
    except UserError:
        return None
    return (f"host-bound: the host's issue time adds {t.host * 1e3:.0f} ms to the step's {t.total * 1e3:.0f}; "
            f"{' '.join(GRAPH_FLAGS)} replays the step as one CUDA graph without it (docs/cuda_graphs.md)")


def grouped_hint(cfg: Config, t: StepTime, cluster: Cluster, rest: list[str], counted) -> Optional[str]:
    """A line where the config's experts run one matmul per expert (no ``--moe-grouped-gemm``, Megatron's default):
    its own layout's step planned again with the flag (``counted(cfg)``: the host's operations and the bytes of that
    config), where that is faster."""
    if not cfg.model.num_experts or cfg.model.moe_grouped_gemm:
        return None
    try:
        grouped, _ = model_config(rest + ["--moe-grouped-gemm"], cluster.gpus, fallback=False)
    except UserError:
        return None
    _, faster = planned(grouped, cluster, *counted(grouped))
    if faster.total >= t.total:
        return None
    return (f"experts: one matmul per expert (no --moe-grouped-gemm): step {t.total:.3f} s; with --moe-grouped-gemm "
            f"(grouped GEMMs, no host synchronisation per layer) {faster.total:.3f} s (docs/moe.md)")


def plan_main(argv: Optional[list[str]] = None, count_host_ops=None, count_traffic=None) -> int:
    """``count_host_ops(cfg, kind)``: the eager operations of (one layer, the rest) (paratron/train/host_ops.py,
    which builds a tiny model: the planner does not); None plans without the host's issue time.
    ``count_traffic(cfg, kind)``: the memory-bound kernels' bytes (paratron/train/traffic.py); None plans without
    them."""
    argv = list(argv or [])
    if argv[:1] in (["-h"], ["--help"]):
        plan_parser().print_help()
        print(__doc__)
        return 0
    args, rest = plan_parser().parse_known_args(argv)
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise ConfigError("--gpus and --gpus-per-node must be >= 1")
    cluster = Cluster(args.gpus, args.gpus_per_node, args.gpu.lower(), args.gpu_memory_gib, args.intra_node_gbps,
                      args.inter_node_gbps, args.matmul_efficiency, args.host_gbps)
    cluster.spec()  # an unknown --gpu, before the model's flags
    if args.fp8 and cluster.spec()[2] is None:
        raise ConfigError(f"--fp8: {cluster.kind} has no FP8 matmuls; plan without --fp8 (or for h100 / h200)")
    cfg, runs = model_config(rest, args.gpus)
    if not_modelled(cfg):
        raise ConfigError(f"paratron plan does not model {not_modelled(cfg)} yet (docs/plan.md); remove it to plan "
                          "the rest")
    def counted(c: Config) -> tuple:
        return (count_host_ops(c, cluster.kind) if count_host_ops is not None else (0, 0),
                count_traffic(c, cluster.kind) if count_traffic is not None else None)
    host_ops, traffic = counted(cfg)
    given = ["as given: the config's own layout does not run on this cluster"]
    if runs:
        mem, t = planned(cfg, cluster, host_ops, traffic)
        fits = mem.total <= cluster.memory
        hints = [graph_hint(t, cluster, rest), grouped_hint(cfg, t, cluster, rest, counted)] if fits else []
        given = [as_given(mem, t, cluster)] + [h for h in hints if h]
    explained = args.top if args.explain is None else args.explain
    for line in report(cfg, cluster, rest, args.fp8, args.top, explained, host_ops, traffic) + [""] + given:
        print(line)
    return 0

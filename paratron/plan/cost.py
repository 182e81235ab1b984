"""Step time of a layout: matmul FLOPs (Megatron's formula, paratron/plan/flops.py) at a stated fraction of
the GPU's dense peak, recomputation's extra forward, the pipeline bubble, and each collective's volume over
the bandwidth of the link its group spans (NVLink inside a node, the network across nodes), exposed unless
it overlaps compute as paratron overlaps it. Every constant that is not the user's is named in
:class:`Cluster` with its source; docs/plan.md lists the assumptions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import ModelConfig
from ..config.check_hybrid import mamba_heads
from ..errors import ConfigError
from .activations import offload_points, offloaded_bytes
from .flops import attention_layers, flops_per_iteration, mla_attention_terms
from .host import ADAM_BYTES, HOST_ADAM_GBPS, HOST_COMPILED_LAYER_MS, HOST_OP_US
from .layout import Layout, fp8_linear_weight
from .shapes import Split, layer, layer_kinds
from .traffic import MEMORY_EFFICIENCY, bandwidth, step_bytes

GB = 1e9
GIB = 1024 ** 3
# kind: (memory GiB (the vendor's GB, in GiB), dense bf16 TFLOP/s, dense fp8 TFLOP/s or None,
#        NVLink GB/s per GPU and direction, network GB/s per GPU) from the vendors' datasheets (SXM parts,
#        one 400 Gb/s NIC per H100/H200, 200 Gb/s per A100)
GPUS = {"h100": (80 * GB / GIB, 989.0, 1979.0, 450.0, 50.0), "h200": (141 * GB / GIB, 989.0, 1979.0, 450.0, 50.0),
        "a100": (80 * GB / GIB, 312.0, None, 300.0, 25.0), "a100-40gb": (40 * GB / GIB, 312.0, None, 300.0, 25.0)}
MATMUL_EFFICIENCY = 0.5  # assumed fraction of the dense peak a layer's matmuls reach (--matmul-efficiency)
# kind: host <-> GPU copy GB/s each way. H100 / H200 hosts (PCIe 5 x16): calibrated on moe-mini mb8 with the experts'
# activations offloaded on an H100 (docs/plan.md); A100 hosts (PCIe 4 x16, half the rate): assumed
HOST_GBPS = {"h100": 53.7, "h200": 53.7, "a100": 25.0, "a100-40gb": 25.0}


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    kind: Optional[str] = "h100"
    memory_gib: Optional[float] = None  # default: the kind's
    intra_gbps: Optional[float] = None  # GB/s per GPU inside a node (default: the kind's NVLink)
    inter_gbps: Optional[float] = None  # GB/s per GPU across nodes (default: the kind's network)
    matmul_efficiency: float = MATMUL_EFFICIENCY
    host_gbps: Optional[float] = None  # host <-> GPU GB/s each way (default: the kind's)
    host_adam_gbps: float = HOST_ADAM_GBPS
    memory_efficiency: float = MEMORY_EFFICIENCY  # fraction of HBM bandwidth the non-matmul kernels reach

    def spec(self) -> tuple:
        if self.kind is None:
            return (None, GPUS["h100"][1], GPUS["h100"][2], GPUS["h100"][3], GPUS["h100"][4])
        if self.kind not in GPUS:
            raise ConfigError(f"--gpu {self.kind}: unknown GPU kind; use one of {', '.join(GPUS)} "
                              "(--gpu-memory-gib and --intra-node-gbps / --inter-node-gbps override its figures)")
        return GPUS[self.kind]

    @property
    def host_link(self) -> float:
        """Host <-> GPU copy GB/s each way: ``host_gbps``, else the kind's (an unnamed kind: an H100 host's)."""
        if self.host_gbps is not None:
            return self.host_gbps
        return HOST_GBPS.get(self.kind or "h100", HOST_GBPS["h100"])

    @property
    def memory(self) -> int:
        gib = self.memory_gib if self.memory_gib is not None else self.spec()[0]
        if gib is None:
            raise ConfigError("give --gpu KIND or --gpu-memory-gib")
        return int(gib * GIB)

    def peak(self, fp8: bool) -> float:
        bf16, f8 = self.spec()[1:3]
        return (f8 if fp8 and f8 else bf16) * 1e12

    def bandwidth(self, extent: int) -> float:
        """Bytes/s per GPU of a group whose ranks span ``extent`` consecutive ranks (Megatron's order)."""
        intra, inter = self.spec()[3:5]
        if extent <= self.gpus_per_node:
            return (self.intra_gbps or intra) * GB
        return (self.inter_gbps or inter) * GB


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step, by part (the exposed share of each collective)."""
    compute: float
    memory: float  # the memory-bound kernels (traffic.py): norms, activations, casts, loss pieces, optimizer
    recompute: float
    bubble: float
    tp: float
    cp: float
    ep: float
    pp: float
    dp: float
    offload: float
    host: float = 0.0  # the host's issue time beyond the GPU's (host.py): the exposed share

    @property
    def total(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> dict:
        return {k: getattr(self, k) for k in ("compute", "memory", "recompute", "bubble", "tp", "cp", "ep", "pp", "dp",
                                              "offload", "host")}


def ring(n: int) -> float:
    """The per-rank traffic factor of a ring all-gather or reduce-scatter over n ranks."""
    return (n - 1) / n if n > 1 else 0.0


def core_flops(model: ModelConfig, batch: int, seq: int) -> float:
    """The attention core's FLOPs of an iteration: megatron_facts section 5's s^2 term (causal as half), over the
    layers whose mixer is attention (a hybrid stack's Mamba-2 / Gated DeltaNet layers have none)."""
    per_pair = mla_attention_terms(model)[1] if model.multi_latent_attention else \
        6.0 * model.kv_channels * model.num_attention_heads
    return float(batch) * seq * seq * per_pair * attention_layers(model)


def recomputed_flops(model: ModelConfig, layout: Layout, batch: int, seq: int) -> float:
    """The forward FLOPs of one iteration that --recompute-modules mlp / moe / shared_experts / mla_up_proj run
    again in backward (the decoder's layers; core_attn is core_flops'; layernorm and moe_act are elementwise)."""
    if layout.recompute != "selective":
        return 0.0
    kinds, h, tokens = layer_kinds(model), model.hidden_size, float(batch) * seq
    e = 3 if model.swiglu or model.quick_geglu else 2

    def mlp(width: float) -> float:  # an MLP's forward (fc1, fc2) per token, width in units of h's rows
        return 2.0 * h * width * e
    dense, moe = (sum(1 for _, ffn in kinds if ffn == kind) for kind in ("dense", "moe"))
    shared = mlp(model.moe_shared_expert_intermediate_size or 0)
    out = dense * mlp(model.ffn_hidden_size) if layout.recomputes("mlp") else 0.0
    if model.num_experts and layout.recomputes("moe"):
        routed = model.moe_ffn_hidden_size * model.moe_router_topk * (model.moe_latent_size or h) / h
        out += moe * (mlp(routed) + shared + 2.0 * h * model.num_experts)
    elif model.num_experts and layout.recomputes("shared_experts"):
        out += moe * shared
    if model.multi_latent_attention and layout.recomputes("mla_up_proj"):
        n, q_in = model.num_attention_heads, model.q_lora_rank or h
        up = q_in * n * (model.qk_head_dim + model.qk_pos_emb_head_dim) + model.kv_lora_rank * n * (
            model.qk_head_dim + model.v_head_dim)
        out += attention_layers(model) * 2.0 * up
    return out * tokens


def fp8_share(model: ModelConfig, layout: Layout) -> float:
    """The share of the layers' matmul FLOPs that run in FP8: all with --fp8-format, less those of the modules
    --te-precision-config-file and --first-last-layers-bf16 keep in bf16, weighed by the weight elements a token
    passes through (the routed experts' by top-k over the number of experts)."""
    if not layout.fp8 or not (layout.fp8_rules or layout.bf16_layers):
        return float(layout.fp8)
    routed = model.moe_router_topk / max(1, model.num_experts or 1)
    fp8 = total = 0.0
    for i, kind in enumerate(layer_kinds(model)):
        for t in layer(model, i, kind, Split()):
            if fp8_linear_weight(t.name):
                w = t.numel * (routed if ".experts." in t.name else 1.0)
                total += w
                fp8 += w if layout.fp8_module(t.name[:-len(".weight")]) else 0.0
    return fp8 / total if total else 1.0


def step_time(model: ModelConfig, vocab: int, layout: Layout, cluster: Cluster, grad_bytes: int,
              param_bytes_dp: int) -> StepTime:
    """``grad_bytes`` / ``param_bytes_dp``: this rank's gradient and weight bytes that data parallelism
    reduces and gathers each step."""
    L, m, a, h = layout, layout.microbatches, layout.param_bytes, model.hidden_size
    total = flops_per_iteration(model, vocab, L.global_batch, L.seq_length)
    core = core_flops(model, L.global_batch, L.seq_length)
    dense_peak, peak = cluster.peak(False) * cluster.matmul_efficiency, cluster.peak(L.fp8) * cluster.matmul_efficiency
    per_gpu = 1.0 / L.world
    head = 6.0 * h * vocab * L.global_batch * L.seq_length  # the output layer (never FP8)
    layers_mm = total - core - head  # the layers' matmuls: FP8 with --fp8-format (fp8_share of them)
    share = fp8_share(model, L)
    per_flop = share / peak + (1.0 - share) / dense_peak  # seconds a FLOP of the layers' matmuls
    compute = per_gpu * (layers_mm * per_flop + (head + core) / dense_peak)
    # full: the layers' forward again (a third of their forward + backward); selective: the attention core's (with
    # core_attn) and the forward of the other modules --recompute-modules names
    recompute = per_gpu * {"full": (layers_mm * per_flop + core / dense_peak) / 3,
                           "selective": (core / dense_peak / 3 if L.recomputes("core_attn") else 0.0)
                           + recomputed_flops(model, L, L.global_batch, L.seq_length) * per_flop
                           }.get(L.recompute, 0.0)
    params = grad_bytes // L.grad_bytes * (L.dp * L.cp if L.zero >= 2 else 1)  # a ZeRO-2/3 shard: the whole
    memory = step_bytes(model, L, params) / (bandwidth(cluster.kind) * cluster.memory_efficiency)
    bubble = (compute + memory + recompute) * (L.pp - 1) / (L.vpp * m)
    tokens = L.micro_batch * L.seq_length // L.cp
    act = tokens * h * a
    kinds = layer_kinds(model)  # per block (a mixer or an MLP): an all-reduce forward, one backward
    blocks = sum((mixer is not None) + (ffn is not None) for mixer, ffn in kinds) / L.pp
    tp = 4 * ring(L.tp) * act * blocks * m / cluster.bandwidth(L.tp)
    kv = model.kv_channels * model.num_query_groups
    attn = attention_layers(model) / L.pp
    cp_comm = 3 * (L.cp - 1) * tokens * 2 * kv * a * attn * m / cluster.bandwidth(L.tp * L.cp)
    cp = max(0.0, cp_comm - core * per_gpu / dense_peak)  # the ring overlaps the attention core only
    cp += recurrent_cp_seconds(model, L, kinds, tokens, a, m, cluster)
    moe_layers = sum(ffn == "moe" for _, ffn in kinds) / L.pp
    ep = 4 * ring(L.ep) * tokens * model.moe_router_topk * h * a * moe_layers * m / cluster.bandwidth(L.ep * L.etp) \
        if model.num_experts else 0.0
    if L.turns and m > 1:  # one micro-batch's all-to-alls unpaired (the first forward's, the last backward's); the
        # rest travel under the other micro-batch's compute (--overlap-moe-expert-parallel-comm, parallel/turns.py)
        ep = ep / m + max(0.0, (ep - compute - memory - recompute) * (m - 1) / m)
    pp = 2 * act / (L.tp if L.sequence_parallel else 1) * m * L.vpp / cluster.bandwidth(L.world) if L.pp > 1 else 0.0
    dp_bw = cluster.bandwidth(L.tp * L.cp * L.dp)
    n, busy = L.dp * L.cp, compute + memory + recompute
    full_grads = grad_bytes * (n if L.zero >= 2 else 1)  # ZeRO-2/3 hold a shard: the collectives move all of it
    full_weights = param_bytes_dp * (n if L.zero >= 3 else 1)
    if L.zero <= 1:  # all-reduce (or reduce-scatter) bucket by bucket during the last micro-batch's backward
        dp = max(0.0, (2 if L.zero == 0 else 1) * ring(n) * full_grads / dp_bw - busy * 2 / 3 / m)
    else:  # no full gradient buffer: a reduce-scatter every micro-batch, during each backward
        dp = max(0.0, m * ring(n) * full_grads / dp_bw - busy * 2 / 3)
    if L.zero in (1, 2):  # the updated weights all-gathered during the next step's first forward
        dp += max(0.0, ring(n) * full_weights / dp_bw - busy / 3 / m)
    if L.zero == 3:  # every layer gathered for each micro-batch's forward and again for its backward, prefetched
        dp += max(0.0, 2 * m * ring(n) * full_weights / dp_bw - busy)
    offload = L.offload_fraction * (grad_bytes + param_bytes_dp) / (cluster.host_link * GB)
    offload += L.offload_fraction * host_adam(grad_bytes // L.grad_bytes, cluster)
    offload += activation_copies(model, L, cluster, busy, m)
    return StepTime(compute, memory, recompute, bubble, tp, cp, ep, pp, dp, offload,
                    host_exposed(model, L, cluster, busy + bubble))


def recurrent_cp_seconds(model: ModelConfig, L: Layout, kinds: list, tokens: int, a: int, m: int,
                         cluster: Cluster) -> float:
    """Seconds the all-to-alls of Mamba-2 and Gated DeltaNet layers under context parallelism take per step (nothing
    runs under them): per layer and micro-batch, the channels that travel to the whole sequence (Mamba-2: x, B, C, dt;
    DeltaNet: q, k, v, beta, alpha) and the output that comes back, each (C - 1) / C of the rank's ``tokens`` x its
    TP share, the forward's two and the backward's two."""
    if L.cp == 1:
        return 0.0
    mamba = sum(mixer == "mamba" for mixer, _ in kinds) / L.pp
    gdn = sum(mixer == "gdn" for mixer, _ in kinds) / L.pp
    heads = mamba_heads(model) if mamba else 0
    inner = heads * model.mamba_head_dim
    mamba_in = inner + 2 * model.mamba_num_groups * model.mamba_state_dim + heads
    keys, values = model.linear_num_key_heads * model.linear_key_head_dim, \
        model.linear_num_value_heads * model.linear_value_head_dim
    gdn_in = 2 * keys + values + 2 * model.linear_num_value_heads
    elements = mamba * (mamba_in + inner) + gdn * (gdn_in + values)
    share = (L.cp - 1) / L.cp * tokens * a / L.tp
    return 2 * share * elements * m / cluster.bandwidth(L.tp * L.cp)


def activation_copies(model: ModelConfig, L: Layout, cluster: Cluster, busy: float, m: int) -> float:
    """Seconds --fine-grained-activation-offloading's copies add to a step: per micro-batch, what the offloaded
    points save (activations.offloaded_bytes, the rank's share of the layers) goes to the host during the forward
    (a third of the compute) and comes back during the backward (two thirds), on a side stream; only what a copy
    takes beyond the compute it runs under is exposed."""
    if not L.offload_modules:
        return 0.0
    kinds, tokens = layer_kinds(model), L.micro_batch * L.seq_length // L.cp
    moved = sum(offloaded_bytes(model, L, kind, points, tokens)
                for kind, points in zip(kinds, offload_points(model, L, kinds))) / L.pp
    copy = moved / (cluster.host_link * GB)
    return m * (max(0.0, copy - busy / 3 / m) + max(0.0, copy - busy * 2 / 3 / m))


def host_adam(params: int, cluster: Cluster) -> float:
    """Seconds of the host's Adam over ``params`` offloaded parameters (host.py), after the backward."""
    return params * ADAM_BYTES / (cluster.host_adam_gbps * GB)


def host_exposed(model: ModelConfig, L: Layout, cluster: Cluster, gpu: float) -> float:
    """The host's issue time of the step's micro-batches beyond the GPU's time ``gpu``: each micro-batch runs at
    the slower of the two (host.py). Full recomputation issues the layers' forward again (a third of their
    forward + backward, taken as). Eager: the counted operations (``host_ops``); compiled: a measured cost per
    layer; a step replayed as one CUDA graph, or a plan for no GPU kind: none."""
    if L.step_graph or cluster.kind not in HOST_OP_US:
        return 0.0
    layers = model.num_layers / L.pp * (4 / 3 if L.recompute == "full" else 1)
    if L.compiled:
        return max(0.0, L.microbatches * layers * HOST_COMPILED_LAYER_MS * 1e-3 - gpu)
    layer_ops, rest = L.host_ops
    if not layer_ops:
        return 0.0
    return max(0.0, L.microbatches * (layer_ops * layers + rest) * HOST_OP_US[cluster.kind] * 1e-6 - gpu)

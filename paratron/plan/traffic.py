"""The memory-bound work of a step: the bytes its non-matmul kernels read and write (norms, activations,
residual adds, rotary, casts, the loss's softmax pieces, MoE's permutations and index operations) and the
optimizer step's, at a stated fraction of the GPU's memory bandwidth (``MEMORY_EFFICIENCY``).

The kernels' bytes are counted, not assumed (``paratron/train/traffic.py``: the planner builds no model; its
callers pass the counts in): one layer's forward and backward and the rest's (embedding, final norm, loss head)
run on the CPU at the model's widths and two short sequences under a dispatch mode that records each aten
operation's input and output bytes, by the region of paratron's code that issued it. Matmuls and the attention
core are not counted (their time is the FLOPs'). Each region is counted two ways: eager (every operation reads
its inputs and writes its outputs) and fused (a run of consecutive operations of the region is one kernel: it
reads what enters the run and writes what leaves it). What the planned GPU runs picks the way per region:

- norms: fused with quack's RMSNorm (``Paths.quack_norm``), else eager (torch's LayerNorm is one operation);
- rotary embedding: none when FlashAttention-4 applies it (``Paths.fused_rope``), else eager;
- SwiGLU: none in quack's gated GEMMs (``Paths.gated_gemm``), else fused (kernels/swiglu.py's Triton kernels);
  the experts' SwiGLU fused;
- the loss (kernels/cross_entropy.py's Triton pass) and gradient accumulation (kernels/accumulate.py): fused;
- everything else eager;
- a compiled layer (--torch-compile): every run of consecutive non-matmul operations between two matmuls (or
  attention cores) taken as one fused kernel (Inductor fuses pointwise and reduction chains), whatever regions.

The optimizer (this rank's share of the parameters that stay on the GPU, ``OPTIMIZER_BYTES``): the gradient
norm's read, the fused AdamW's reads of the fp32 master, gradient and two moments and writes of the master,
the moments and (mixed precision) the model's weight, and the gradient buffer's zeroing.

Bandwidths (``HBM_GBPS``): NVIDIA's datasheets (H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80GB SXM 2.039 TB/s,
A100 40GB 1.555 TB/s)."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig

HBM_GBPS = {"h100": 3350.0, "h200": 4800.0, "a100": 2039.0, "a100-40gb": 1555.0}  # datasheets, GB/s per GPU
MEMORY_EFFICIENCY = 0.6  # assumed (not fitted) fraction of HBM bandwidth the non-matmul kernels reach (docs/plan.md)
EAGER, FUSED, NONE = "eager", "fused", "none"


@dataclass(frozen=True)
class Traffic:
    """Counted bytes, per region of one layer (``layer``) and of the rest (``rest``): tuples of
    (region, phase "F"/"B", eager fixed, eager per token, fused fixed, fused per token); ``compiled``: (layer
    fixed, layer per token, rest fixed, rest per token) with every run of non-matmul operations fused, and the
    forward's share of the layer's (fixed, per token) as ``compiled_forward``. Fixed bytes are per micro-batch
    (what does not grow with the tokens: casts of weights, embedding-gradient buffers)."""
    layer: tuple = ()
    rest: tuple = ()
    compiled: tuple = (0.0, 0.0, 0.0, 0.0)
    compiled_forward: tuple = (0.0, 0.0)


def way(region: str, paths, compiled: bool) -> str:
    """How the planned GPU runs a region's operations (module docstring)."""
    if compiled:
        return FUSED
    if region == "norm":
        return FUSED if paths.quack_norm else EAGER
    if region == "rope":
        return NONE if paths.fused_rope else EAGER
    if region == "swiglu":
        return NONE if paths.gated_gemm else FUSED
    if region in ("swiglu-experts", "loss", "accumulate"):
        return FUSED
    return EAGER


def region_bytes(rows: tuple, paths, tokens: float, forward_only: bool = False, split: tuple = (1, 1)) -> float:
    """Bytes of a micro-batch of ``tokens`` of the regions ``rows`` (Traffic.layer or .rest), each the way the
    planned GPU runs it; ``forward_only``: the forward's only (full recomputation's repeat). The fixed bytes (the
    weight-sized ones) are divided by ``split``: (TP, EP x expert-TP), the second for the experts' regions."""
    total = 0.0
    for region, phase, e_fixed, e_tok, f_fixed, f_tok in rows:
        if forward_only and phase != "F":
            continue
        how, parts = way(region, paths, False), split[1] if region.endswith("-experts") else split[0]
        if how == EAGER:
            total += e_fixed / parts + e_tok * tokens
        elif how == FUSED:
            total += f_fixed / parts + f_tok * tokens
    return total


def optimizer_bytes(param_bytes: int, grad_bytes: int, moment_bytes: int = 8) -> int:
    """Bytes moved per parameter by the optimizer step on the GPU: the gradient norm reads the gradient; the
    fused AdamW reads the fp32 master, the gradient and the two moments (``moment_bytes`` together: 8 in fp32) and
    writes the master, the moments and (mixed precision) the model's weight; the buffer is zeroed for the next
    step."""
    adam = (4 + grad_bytes + moment_bytes) + (4 + moment_bytes) + (param_bytes if param_bytes < 4 else 0)
    return grad_bytes + adam + grad_bytes


def fixed_divisor(rows: tuple, L) -> float:
    """What a layer's fixed bytes counted whole are divided by on a rank of layout ``L``: TP, and EP x expert-TP for
    the experts' share of the eager count's fixed bytes (the compiled count has no regions)."""
    experts = sum(r[2] for r in rows if r[0].endswith("-experts"))
    total = sum(r[2] for r in rows)
    if total <= 0 or experts <= 0:
        return float(L.tp)
    share = experts / total
    return 1.0 / ((1 - share) / L.tp + share / (L.ep * L.etp))


def step_bytes(model: ModelConfig, L, params: int) -> float:
    """Bytes of a step's memory-bound kernels on one GPU of layout ``L`` (Layout): every micro-batch's layers
    (this pipeline stage's share; tokens divided over TP and CP, weight-sized bytes over TP or, the experts',
    EP x expert-TP) and the rest, the full recomputation's repeated
    forward, and the optimizer over this rank's ``params`` (its share under ZeRO, those left on the GPU). The rest
    counts whole on every stage (the fullest: the loss head's)."""
    t = L.traffic
    if t is None:
        return 0.0
    tokens = L.micro_batch * L.seq_length / (L.cp * L.tp)
    layers = model.num_layers / L.pp
    if L.compiled:  # (one figure for every region: its fixed bytes split as the eager count's are)
        fixed, tok, rest_fixed, rest_tok = t.compiled
        per = fixed_divisor(t.layer, L)
        layer = fixed / per + tok * tokens
        again = t.compiled_forward[0] / per + t.compiled_forward[1] * tokens
        rest = rest_fixed / L.tp + rest_tok * tokens
    else:
        split = (L.tp, L.ep * L.etp)
        layer = region_bytes(t.layer, L.paths, tokens, split=split)
        again = region_bytes(t.layer, L.paths, tokens, forward_only=True, split=split)
        rest = region_bytes(t.rest, L.paths, tokens, split=split)
    layer += again if L.recompute == "full" else 0.0
    opt = params * (1 - L.offload_fraction) * optimizer_bytes(L.param_bytes, L.grad_bytes, L.moment_bytes)
    return L.microbatches * (layer * layers + rest) + opt / (L.dp * L.cp if L.zero >= 1 else 1)


def bandwidth(kind) -> float:
    """Bytes/s of a GPU kind's memory (None: an H100's)."""
    return HBM_GBPS.get(kind or "h100", HBM_GBPS["h100"]) * 1e9

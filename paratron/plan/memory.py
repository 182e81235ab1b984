"""Per-GPU memory of a layout: model state (state.py), activations (activations.py), communication buffers
and the allocator's slack, for one pipeline rank or the fullest one. What the start-up lines of every run
print (:func:`startup_lines`) and what ``paratron plan`` ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import Config, ConfigError, ModelConfig
from ..config.check_hybrid import gdn_chunk_size
from .activations import chunk_bytes, in_flight
from .layout import Layout, fp8_linear_weight, layout_of
from .shapes import Split, layer_kinds
from .state import State, chunk_tensors, rank_chunks, state

GIB = 1024 ** 3
ALLOCATOR_SLACK = 0.10  # assumed: the caching allocator's reserve beyond the peak allocated (not measured yet)


@dataclass(frozen=True)
class Memory:
    """Bytes on one GPU (``host``: offloaded optimizer state in host memory)."""
    weights: int
    grads: int
    optimizer: int
    activations: int  # saved for backward, all micro-batches in flight
    working: int  # the backward's working set: one layer (or recomputed group) at a time
    comm: int  # communication buffers: pipeline sends, TP/EP gathers, ZeRO-2/3 buckets and gathered layers
    host: int
    pp_rank: int
    slack_fraction: float = ALLOCATOR_SLACK

    @property
    def peak(self) -> int:
        """The predicted peak of allocated memory (torch.cuda.max_memory_allocated)."""
        return self.weights + self.grads + self.optimizer + self.activations + self.working + self.comm

    @property
    def slack(self) -> int:
        return int(self.peak * self.slack_fraction)

    @property
    def total(self) -> int:
        """What the GPU must hold: the peak and the allocator's slack."""
        return self.peak + self.slack

    def parts(self) -> list[tuple[str, int]]:
        return [("weights", self.weights), ("gradients", self.grads), ("optimizer", self.optimizer),
                ("activations", self.activations + self.working), ("comm buffers", self.comm),
                ("allocator slack", self.slack)]


def comm_bytes(model: ModelConfig, layout: Layout, st: State, layer_params: int, cached_fp8: int = 0) -> int:
    """Transient buffers of the collectives, per rank: pipeline send/receive of one micro-batch's hidden
    states (both directions), the experts' all-to-all
    (top-k copies there and back), ZeRO-2's gradient bucket before its reduce-scatter and ZeRO-3's gathered
    layer (two with --overlap-param-gather: the next one is prefetched; FP8 weights with --fp8-param-gather).
    FP8: one layer's weight copies and their transposes, and, where a step of several micro-batches casts the dense
    FP8 weights once (fp8/weights.py), those of every dense FP8 layer of the rank (``cached_fp8`` weight elements)
    for the whole step."""
    a, h = layout.param_bytes, model.hidden_size
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    out = 0
    if layout.pp > 1:
        out += 2 * tokens * h * a // (layout.tp if layout.sequence_parallel else 1)
    if model.num_experts and layout.ep > 1:
        out += 2 * tokens * model.moe_router_topk * h * a
    if layout.zero >= 2:
        out += st.largest_bucket * layout.grad_bytes
    if layout.zero >= 3:
        gathered = 1 if layout.fp8 and layout.fp8_param_gather else a
        out += (2 if layout.overlap_param_gather else 1) * layer_params * gathered
    if layout.fp8:  # FP8 copies of the weights and their transposes
        out += 2 * (layer_params + (cached_fp8 if fp8_weights_cached(layout) else 0))
    return out


def fp8_saved_weights(layout: Layout, tensors) -> int:
    """FP8: the e4m3 copies of a chunk's layer weights (one byte an element) that each micro-batch's forward keeps
    for its backward; the dense layers' are the step's cached copies where the step casts them once (counted with
    the communication buffers, comm_bytes), the routed experts' always their own."""
    if not layout.fp8:
        return 0
    if fp8_weights_cached(layout):
        return fp8_weight_elements(tensors, layout, dense=False)
    return fp8_weight_elements(tensors, layout)


def fp8_weight_elements(tensors, layout: Layout, dense: bool = True, experts: bool = True) -> int:
    """Elements of the weights of the FP8 layers (paratron/fp8/recipe.py's LAYERS) among ``tensors``: the dense
    layers' and / or the routed experts', those ``layout`` runs in FP8 (Layout.fp8_module)."""
    return sum(t.numel for t in tensors if fp8_linear_weight(t.name) and (experts if ".experts." in t.name else dense)
               and layout.fp8_module(t.name[:-len(".weight")]))


def fp8_weights_cached(layout: Layout) -> bool:
    """Whether the step casts the FP8 weights once for its micro-batches (fp8/weights.py's conditions)."""
    return (layout.fp8 and layout.fp8_weight_cache and layout.microbatches > 1 and layout.zero < 3
            and not layout.overlap_param_gather)


def state_key(layout: Layout) -> Layout:
    """The layout with what model state does not depend on cleared (the search's cache key)."""
    return layout.replace(micro_batch=1, global_batch=1, recompute=None, recompute_num_layers=None, fp8=False,
                          fp8_param_gather=False, overlap_param_gather=False, seq_length=1)


def rank_state(model: ModelConfig, vocab: int, layout: Layout, pp_rank: int, par=None, ranks: Optional[dict] = None,
               split: Optional[Split] = None, cache: Optional[dict] = None) -> tuple[list, list, State]:
    """(chunks, their tensors, the state) of pipeline rank ``pp_rank``; ``cache``: a dict kept between calls."""
    key = (state_key(layout), vocab, pp_rank)
    memo = cache if ranks is None and split is None else None
    if memo is not None and key in memo:
        return memo[key]
    split = split or Split(layout.tp, layout.ep, layout.etp)
    shape = ("tensors", layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp, vocab, pp_rank)
    if memo is None or shape not in memo:  # (the parameters: the same for every sharding, DP size and bucketing)
        chunks = rank_chunks(model, layout, pp_rank, par)
        found = chunks, chunk_tensors(model, vocab, layout, chunks, split)
        if memo is None:
            return (*found, state(found[1], layout, ranks or {}))
        memo[shape] = found
    chunks, tensors = memo[shape]
    out = memo[key] = chunks, tensors, state(tensors, layout, {}, memo, shape)
    return out


def rank_memory(model: ModelConfig, vocab: int, layout: Layout, pp_rank: int, par=None,
                ranks: Optional[dict] = None, split: Optional[Split] = None, cache: Optional[dict] = None) -> Memory:
    """Memory of pipeline rank ``pp_rank``; ``ranks``/``split``: this rank's coordinates (default: the
    fullest data-parallel shard, tensor/expert rank 0)."""
    chunks, tensors, st = rank_state(model, vocab, layout, pp_rank, par, ranks, split, cache)
    kinds = layer_kinds(model)
    flight = in_flight(layout, pp_rank)
    acts = working = 0
    for (first, count, pre, post), ts in zip(chunks, tensors):
        saved, work = chunk_bytes(model, layout, kinds[first: first + count], vocab, pre, post, first)
        saved += fp8_saved_weights(layout, ts)
        acts += saved * flight // layout.vpp  # interleaved: the chunk micro-batches in flight, spread over chunks
        working = max(working, work)
    layer_params = max((sum(t.numel for t in ts if ".layers." in t.name) // max(1, c[1])
                        for ts, c in zip(tensors, chunks)), default=0)
    dense = sum(fp8_weight_elements(ts, layout, experts=False) for ts in tensors) if layout.fp8 else 0
    return Memory(st.weights, st.grads, st.optimizer, acts, working,
                  comm_bytes(model, layout, st, layer_params, dense), st.host, pp_rank)


def fullest(model: ModelConfig, vocab: int, layout: Layout, par=None) -> Memory:
    """The pipeline rank that needs the most memory."""
    ranks = range(layout.pp) if layout.pp <= 4 else sorted({0, 1, layout.pp - 1})
    return max((rank_memory(model, vocab, layout, r, par) for r in ranks), key=lambda m: m.total)


def gib(n: int) -> str:
    """Bytes in GiB (MiB below one GiB: the tiny models of a first run)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def describe(mem: Memory) -> str:
    return ", ".join(f"{name} {gib(n)}" for name, n in mem.parts())


def not_modelled(cfg: Config) -> Optional[str]:
    """What of this run the memory model does not count (None: all of it)."""
    missing = linear_scans_not_modelled(cfg)
    if missing:
        return missing
    return f"--optimizer {cfg.optim.optimizer}" if cfg.optim.optimizer != "adam" else None


def linear_scans_not_modelled(cfg: Config) -> Optional[str]:
    """What of a stack's Mamba-2 / Gated DeltaNet layers the activations do not count, with the reason: only the
    torch scans are, with and without their recomputation (``auto`` plans torch: fla-core is refused for training
    on Hopper with the Triton torch 2.11 ships, docs/hybrid.md)."""
    if not any(mixer in ("mamba", "gdn") for mixer, _ in layer_kinds(cfg.model)):
        return None
    k = cfg.kernels
    if k.kernel_linear_scan == "fla":
        return "--kernel-linear-scan fla (fla-core's saved tensors are not counted; plan the torch scans)"
    if k.kernel_linear_scan_recompute == "off":
        chunks = {gdn_chunk_size(cfg.model) if mixer == "gdn" else cfg.model.mamba_chunk_size
                  for mixer, _ in layer_kinds(cfg.model) if mixer in ("mamba", "gdn")}
        if any(cfg.model.seq_length % q or cfg.model.seq_length < 2 * q for q in chunks):
            return ("--kernel-linear-scan-recompute off with a sequence that is not two or more whole scan chunks "
                    "(--mamba-chunk-size: the padded and the single-chunk scans' saved copies are not counted)")
    if cfg.train.fp8_format is not None:
        return "--fp8-format with Mamba-2 / Gated DeltaNet layers (their FP8 copies are not counted)"
    return None


def startup_lines(cfg: Config, pp_rank: Optional[int] = None) -> list[str]:
    """The memory lines every run prints at start-up: this rank's (``pp_rank``) or the fullest rank's
    predicted peak and its parts (one line saying why not, for a run the model does not count)."""
    missing = not_modelled(cfg)
    if missing:
        return [f" memory plan: not available for runs with {missing} (docs/plan.md)"]
    layout = layout_of(cfg)
    try:
        mem = (fullest(cfg.model, cfg.padded_vocab_size, layout, cfg.parallel) if pp_rank is None
               else rank_memory(cfg.model, cfg.padded_vocab_size, layout, pp_rank, cfg.parallel))
    except ConfigError as e:  # a layout the planner cannot split (the run itself checked it already)
        return [f" memory plan: not available ({e})"]
    where = f"pipeline rank {mem.pp_rank}" if layout.pp > 1 else "each rank"
    lines = [f" memory plan ({where}, {layout.sharding} sharding, recompute {layout.recompute or 'none'}): "
             f"predicted peak {gib(mem.peak)} allocated, {gib(mem.total)} with allocator slack",
             f"   {describe(mem)}"]
    if mem.host:
        lines.append(f"   host (optimizer offload): {gib(mem.host)}")
    return lines


def dry_run(cfg: Config) -> dict:
    """``--dry-run``: the memory plan printed (once per job), nothing built; the result of a run that trained
    no step."""
    import os
    if os.environ.get("RANK", "0") == "0":
        for line in startup_lines(cfg):
            print(line, flush=True)
    return {"iteration": 0, "exit_reason": "dry run", "valid_loss": None, "train_curve": [], "valid_curve": []}

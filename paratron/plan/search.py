"""The layout search of ``paratron plan``: every layout of the cluster that the model allows (TP dividing the
heads and query groups inside a node, PP dividing the layers, virtual stages, CP, EP dividing the experts,
micro-batch, the sharding strategies and offload the config accepts, recomputation), its memory on the
fullest pipeline rank, and for those that fit, the predicted step time; ranked by tokens/s."""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Iterator, Optional

from ..config import FIELD_SECTION, ModelConfig
from .cost import Cluster, StepTime, step_time
from .layout import STRATEGIES, Layout, layout_of
from .memory import Memory, fullest, rank_memory, rank_state

RECOMPUTE = (None, "selective", "full")
MICRO_BATCHES = (1, 2)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: Memory
    time: Optional[StepTime]  # None when it does not fit

    @property
    def tokens_per_s(self) -> float:
        return self.layout.global_batch * self.layout.seq_length / self.time.total if self.time else 0.0


def strategies() -> tuple:
    """The data-parallel sharding strategies this paratron's config accepts."""
    return STRATEGIES if "data_parallel_sharding_strategy" in FIELD_SECTION else STRATEGIES[:2]


def offloads() -> tuple:
    return (0.0, 1.0) if "optimizer_cpu_offload" in FIELD_SECTION else (0.0,)


def divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def padded_vocab(vocab: int, multiple: int, tp: int) -> int:
    m = multiple * tp
    return int(math.ceil(vocab / m) * m)


def recurrent_split(model: ModelConfig) -> int:
    """What TP x CP must divide for the model's Mamba-2 heads and groups and Gated DeltaNet key heads (0: no such
    layer)."""
    from ..config.check_hybrid import mamba_heads, uses
    sizes = ([mamba_heads(model), model.mamba_num_groups] if uses(model, "M") else []) + \
        ([model.linear_num_key_heads] if uses(model, "G") else [])
    return math.gcd(*sizes) if sizes else 0


def parallel_shapes(model: ModelConfig, cluster: Cluster, global_batch: int, seq: int) -> Iterator[dict]:
    """(tp, pp, vpp, cp, ep, etp, dp) the model and cluster allow."""
    n, node = cluster.gpus, cluster.gpus_per_node
    heads_ok = math.gcd(model.num_attention_heads, model.num_query_groups)
    recurrent = recurrent_split(model)
    cps = (1, 2, 4, 8) if model.attention_dropout == 0 else (1,)  # no attention dropout across CP ranks
    for tp, pp, cp in product(divisors(heads_ok, node), divisors(model.num_layers, n), cps):
        if n % (tp * pp * cp) or seq % (2 * cp) and cp > 1 or recurrent % (tp * cp):
            continue
        dp = n // (tp * pp * cp)
        if global_batch % dp:
            continue
        for vpp in ([1] if pp == 1 else [v for v in (1, 2, 4) if (model.num_layers // pp) % v == 0]):
            for ep in (divisors(model.num_experts, tp * cp * dp) if model.num_experts else [1]):
                for etp in ([1] if model.num_experts else [tp]):  # experts: expert-TP 1, as Megatron advises with EP
                    if (tp * cp * dp) % (ep * etp) == 0:
                        yield dict(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp)


def candidates(model: ModelConfig, cluster: Cluster, base: Layout, fp8: bool) -> Iterator[list[Layout]]:
    """Groups of layouts in the order to try them: each group differs only in recomputation and offload,
    cheapest first (the search keeps the first of a group that fits)."""
    for shape in parallel_shapes(model, cluster, base.global_batch, base.seq_length):
        per_rank = base.global_batch // shape["dp"]
        for mb, sharding in product(MICRO_BATCHES, strategies()):
            m = per_rank // mb if per_rank % mb == 0 else 0
            if not m or (shape["vpp"] > 1 and m % shape["pp"]) or (sharding != "no_shard" and shape["dp"] * shape["cp"]
                                                                  == 1):
                continue
            yield [base.replace(**shape, micro_batch=mb, sharding=sharding, recompute=recompute,
                                offload_fraction=offload, sequence_parallel=shape["tp"] > 1, fp8=fp8,
                                recompute_method="uniform", recompute_num_layers=1 if recompute == "full" else None)
                   for offload, recompute in product(offloads(), RECOMPUTE)
                   if not (offload and sharding == "no_shard")]


def dp_bytes(model: ModelConfig, vocab: int, layout: Layout, cache: dict) -> tuple[int, int]:
    """(gradient bytes, weight bytes) of the first pipeline rank that data parallelism moves each step."""
    st = rank_state(model, vocab, layout, 0, cache=cache)[2]
    return st.grads, st.weights


def planned(cfg, cluster: Cluster, host_ops: tuple = (0, 0), traffic=None) -> tuple[Memory, StepTime]:
    """A resolved config's own layout on ``cluster``: the memory of its fullest pipeline rank and its step time
    (``host_ops``, ``traffic``: as :func:`paratron.plan.layout.layout_of` takes them)."""
    layout, v = layout_of(cfg, cluster.kind, host_ops, traffic), cfg.padded_vocab_size
    return fullest(cfg.model, v, layout, cfg.parallel), step_time(cfg.model, v, layout, cluster,
                                                                  *dp_bytes(cfg.model, v, layout, {}))


def search(model: ModelConfig, vocab: int, multiple: int, cluster: Cluster, base: Layout, fp8: bool = False,
           padded: Optional[int] = None) -> list[Candidate]:
    """Every candidate layout (of each group the first that fits), ranked by :func:`rank_key`. ``vocab``: the
    tokenizer's vocabulary, padded per TP size by ``multiple`` (or ``padded`` when given)."""
    out, limit, cache = [], cluster.memory, {}
    for group in candidates(model, cluster, base, fp8):
        for layout in group:
            v = padded or padded_vocab(vocab, multiple, layout.tp)
            ranks = range(layout.pp) if layout.pp <= 2 else (0, layout.pp - 1)
            mem = max((rank_memory(model, v, layout, r, cache=cache) for r in ranks), key=lambda x: x.total)
            fits = mem.total <= limit
            time = step_time(model, v, layout, cluster, *dp_bytes(model, v, layout, cache)) if fits else None
            if fits or layout is group[-1]:
                out.append(Candidate(layout, mem, time))
                break
    return sorted(out, key=rank_key)


def rank_key(c: Candidate) -> tuple:
    """Fits first; then tokens/s (to 4 significant digits: a tie when all communication is hidden); then the
    fewest model-parallel ranks and the least sharding (the model has no cost for small matmuls nor for a
    collective's latency); then memory."""
    L = c.layout
    speed = float(f"{c.tokens_per_s:.4g}")
    return c.time is None, -speed, L.tp * L.pp * L.vpp * L.cp * L.ep, L.zero, c.memory.total

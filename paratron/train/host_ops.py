"""The eager aten operations one micro-batch of a model issues from the host, counted (paratron plan's host
model, paratron/plan/host.py, takes them): one layer's forward and backward and the rest's (embedding, final
norm, loss head), run once on the CPU at tiny widths with the same structure (norms, activation, experts, FP8
recipe) under a dispatch mode that counts the aten operations. Here, in train, because it builds a model; the
planner is given the counts (``paratron plan`` and benchmarks/train_throughput.py pass them)."""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import Config, finalize
from ..config.precision_file import fp8_recipes
from ..config.values import BLOCKWISE_TILE
from .distributed import build_dims
from .step import build_model_chunks


class OpCounter(TorchDispatchMode):
    """The aten operations dispatched, by name (views and metadata included: each is a host call)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    @property
    def count(self) -> int:
        return len(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def tile_aligned(cfg: Config) -> bool:
    """Whether the run's FP8 GEMMs take whole 128-wide tiles: a blockwise recipe, given or named by a matcher of
    --te-precision-config-file (a counted copy's widths and tokens must then be multiples of the tile too)."""
    return "blockwise" in fp8_recipes(cfg.train)


def tiny_copy(cfg: Config, layers: int, kind: Optional[dict] = None) -> Config:
    """``cfg``'s model at tiny widths with ``layers`` layers (of one ``kind``: kind_copies'), on one rank, eager:
    the same operations per layer (widths and tokens of whole 128-wide tiles under a blockwise FP8 recipe)."""
    c = as_kind(cfg.unfrozen(), kind or {}, layers)
    m = c.model
    t = BLOCKWISE_TILE if tile_aligned(cfg) else 1
    groups = max(1, m.num_attention_heads // max(1, m.num_query_groups or m.num_attention_heads))
    m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_channels = layers, max(64, t), 4, max(16, t)
    m.num_query_groups = max(1, 4 // groups) if m.group_query_attention else None
    m.ffn_hidden_size, m.seq_length, m.max_position_embeddings = 128, max(16, t), max(16, t)
    if m.num_experts:  # every layer of the MoE kind (a pattern of the model's layers does not fit one or two)
        m.moe_ffn_hidden_size, m.moe_layer_freq = max(32, t), 1
        m.moe_shared_expert_intermediate_size = max(32, t) if m.moe_shared_expert_intermediate_size else None
    m.mtp_num_layers = None
    m.mamba_head_dim, m.mamba_num_groups, m.mamba_state_dim, m.mamba_num_heads = 16, 2, 16, None
    m.linear_key_head_dim, m.linear_value_head_dim, m.linear_num_key_heads = 16, 16, 2
    m.linear_num_value_heads = 2 * max(1, cfg.model.linear_num_value_heads // cfg.model.linear_num_key_heads)
    c.data.vocab_size, m.make_vocab_size_divisible_by = 512, 32
    return one_rank_eager(c)


def kind_copies(cfg: Config) -> list[tuple[float, dict]]:
    """(share of the layers, model fields) of each distinct layer kind of a hybrid stack, whose one- and two-layer
    copies are counted apart and summed by the pattern's multiplicities; [(1.0, {})] for a uniform stack (MoE
    models count their MoE kind: see ops_per_layer)."""
    m, n = cfg.model, cfg.model.num_layers
    if m.hybrid_layer_pattern is not None:
        symbols = [s for s in m.hybrid_layer_pattern if s != "|"]
        return [(symbols.count(s) / n, {"hybrid_layer_pattern": s}) for s in dict.fromkeys(symbols)]
    if m.experimental_attention_variant is not None:
        from ..config.layer_patterns import linear_attention_layers
        linear = linear_attention_layers(m.linear_attention_freq, n)
        return [(sum(g == x for g in linear) / n, {"linear_attention_freq": f"[{int(x)}]"}) for x in (True, False)
                if x in linear]
    return [(1.0, {})]


def as_kind(c: Config, fields: dict, layers: int) -> Config:
    """The unfrozen copy ``c`` with ``layers`` layers all of one kind (``fields``: kind_copies')."""
    m = c.model
    if "hybrid_layer_pattern" in fields:  # (one rank: the pattern's pipeline stages dropped)
        m.hybrid_layer_pattern = fields["hybrid_layer_pattern"] * layers
        c.set("pipeline_model_parallel_layout", None)
    if "linear_attention_freq" in fields:
        m.linear_attention_freq = "[" + ",".join([fields["linear_attention_freq"][1:-1]] * layers) + "]"
    return c


def one_rank_eager(c: Config) -> Config:
    """The unfrozen copy ``c`` finalized as one rank's run of one micro-batch, eager, without recomputation, every
    layer in the run's precision, on mock data (the counted copies of host_ops and traffic)."""
    c.train.micro_batch_size, c.train.global_batch_size, c.train.torch_compile = 1, 1, False
    c.train.recompute_granularity = None
    c.train.first_last_layers_bf16 = False  # (a copy of one or two layers counts an FP8 layer, as most of the model's)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        c.set(name, 1)
    c.set("virtual_pipeline_model_parallel_size", None)
    c.set("expert_tensor_parallel_size", None)
    c.data.mock_data = True
    return finalize(c, 1)


def count_ops(cfg: Config) -> int:
    """aten operations of one forward and backward of ``cfg``'s model (one micro-batch) on the CPU."""
    model = build_model_chunks(cfg, build_dims(cfg), torch.device("cpu"))[0]
    tokens = torch.randint(0, 500, (1, cfg.model.seq_length), generator=torch.Generator().manual_seed(0))
    with OpCounter() as counter:
        model(tokens, labels=tokens).float().sum().backward()
    return counter.count


def ops_per_layer(cfg: Config) -> tuple[int, int]:
    """(operations of one layer's forward + backward, of the rest: embedding, final norm, loss head), counted on
    tiny copies of one and two layers. MoE models count the layer of their first MoE kind; hybrid stacks each
    kind of layer apart, one layer the mean over the pattern (kind_copies)."""
    layer = rest = 0.0
    for share, kind in kind_copies(cfg):
        n1, n2 = count_ops(tiny_copy(cfg, 1, kind)), count_ops(tiny_copy(cfg, 2, kind))
        layer, rest = layer + share * (n2 - n1), rest + share * (2 * n1 - n2)
    return round(layer), round(rest)


def host_ops_for(cfg: Config, kind: Optional[str]) -> tuple[int, int]:
    """What a GPU plan of ``kind`` takes as the host's operations: counted for an eager run, (0, 0) when the
    plan is not for a GPU, the run compiles its layers (--torch-compile: Inductor's code issues them) or replays its
    step as a CUDA graph (--cuda-graph-impl local: one call a step)."""
    if kind is None or cfg.train.torch_compile or cfg.train.cuda_graph_impl == "local":
        return 0, 0
    return ops_per_layer(cfg)

"""The parameters one rank holds, as the model builds them: name, elements on this rank, the gradient group
they are reduced over and whether they are a tied pair's copy, in module order (the order the gradient
buffers lay them out in, reversed). Read off the resolved model config and the layout alone, so the planner
can count a 405B model on a laptop; tests/unit/test_plan_memory.py compares it with the real model's tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import ModelConfig
from ..config.check_hybrid import mamba_heads
from ..config.layer_patterns import linear_attention_layers, parse_moe_layer_freq

WORD_EMBEDDING = "embedding.word_embeddings.weight"
CONV_WIDTH = 4  # Mamba-2's convolution taps (model/mamba.py; not a flag)


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int  # elements on this rank
    group: str = "dp_cp"  # the gradient's data-parallel group: dp_cp (dense) | edp (experts)
    tied: Optional[str] = None  # "embedding": a tied pair's copy on a pipeline's first or last stage


@dataclass(frozen=True)
class Split:
    """This rank's place on the axes that cut parameters: tensor, expert and expert-tensor parallelism."""
    tp: int = 1
    ep: int = 1
    etp: int = 1
    tp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0


def part(n: int, size: int, rank: int) -> int:
    """Elements of ``n`` on rank ``rank`` of ``size`` when cut as equally as possible."""
    return n // size + (1 if rank < n % size else 0)


# Megatron's hybrid symbols -> (mixer, MLP) of the layer, as model/spec.py builds them.
HYBRID = {"M": ("mamba", None), "G": ("gdn", None), "*": ("attention", None), "-": (None, "dense"),
          "E": (None, "moe")}


def layer_kinds(cfg: ModelConfig) -> list[tuple]:
    """(mixer, MLP) of every layer, as model/spec.py's layer_specs: attention | mamba | gdn | None and dense | moe |
    None (a hybrid pattern's layer has one of the two)."""
    n = cfg.num_layers
    if cfg.hybrid_layer_pattern is not None:
        return [HYBRID[s] for s in cfg.hybrid_layer_pattern if s != "|"]
    moe = parse_moe_layer_freq(cfg.moe_layer_freq, n) if cfg.num_experts else [0] * n
    gdn = linear_attention_layers(cfg.linear_attention_freq, n) if cfg.experimental_attention_variant else [0] * n
    return [("gdn" if g else "attention", "moe" if m else "dense") for m, g in zip(moe, gdn)]


def norm(prefix: str, cfg: ModelConfig, size: int) -> list[Tensor]:
    out = [Tensor(prefix + ".weight", size)]
    return out + [Tensor(prefix + ".bias", size)] if cfg.normalization == "LayerNorm" else out


def mlp(prefix: str, cfg: ModelConfig, ffn: int, s: Split) -> list[Tensor]:
    """A dense MLP (or a shared expert) of width ``ffn``, split over TP."""
    width = ffn * (2 if (cfg.swiglu or cfg.quick_geglu) else 1)
    bias = not cfg.disable_bias_linear
    out = [Tensor(f"{prefix}.linear_fc1.weight", part(width, s.tp, s.tp_rank) * cfg.hidden_size)]
    out += [Tensor(f"{prefix}.linear_fc1.bias", part(width, s.tp, s.tp_rank))] if bias else []
    out += [Tensor(f"{prefix}.linear_fc2.weight", cfg.hidden_size * part(ffn, s.tp, s.tp_rank))]
    return out + ([Tensor(f"{prefix}.linear_fc2.bias", cfg.hidden_size)] if bias else [])


def attention(prefix: str, cfg: ModelConfig, s: Split) -> list[Tensor]:
    if cfg.multi_latent_attention:
        return mla(prefix, cfg, s)
    d, h = cfg.kv_channels, cfg.hidden_size
    parts = 2 if cfg.attention_output_gate else 1
    qkv = (cfg.num_attention_heads * parts + 2 * cfg.num_query_groups) * d
    rows = part(qkv, s.tp, s.tp_rank)
    out = [Tensor(f"{prefix}.linear_qkv.weight", rows * h)]
    out += [Tensor(f"{prefix}.linear_qkv.bias", rows)] if (not cfg.disable_bias_linear or cfg.add_qkv_bias) else []
    if cfg.qk_layernorm:
        out += norm(f"{prefix}.q_layernorm", cfg, d) + norm(f"{prefix}.k_layernorm", cfg, d)
    out += [Tensor(f"{prefix}.linear_proj.weight", h * part(cfg.num_attention_heads * d, s.tp, s.tp_rank))]
    out += [Tensor(f"{prefix}.linear_proj.bias", h)] if not cfg.disable_bias_linear else []
    if cfg.softmax_type == "learnable":  # a sink logit per head (model/attention/windowed.py)
        out.append(Tensor(f"{prefix}.core_attention.softmax_offset", part(cfg.num_attention_heads, s.tp, s.tp_rank)))
    return out


def mla(prefix: str, cfg: ModelConfig, s: Split) -> list[Tensor]:
    """Multi-latent attention: replicated down projections, TP-split up projections (model/mla.py)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    out = []
    if cfg.q_lora_rank is None:
        out.append(Tensor(f"{prefix}.linear_q_proj.weight", part(heads * qk, s.tp, s.tp_rank) * h))
    else:
        out.append(Tensor(f"{prefix}.linear_q_down_proj.weight", cfg.q_lora_rank * h))
        out.append(Tensor(f"{prefix}.linear_q_up_proj.weight", part(heads * qk, s.tp, s.tp_rank) * cfg.q_lora_rank))
    out.append(Tensor(f"{prefix}.linear_kv_down_proj.weight", (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) * h))
    up = heads * (cfg.qk_head_dim + cfg.v_head_dim)
    out.append(Tensor(f"{prefix}.linear_kv_up_proj.weight", part(up, s.tp, s.tp_rank) * cfg.kv_lora_rank))
    if cfg.qk_layernorm:
        out += norm(f"{prefix}.q_layernorm", cfg, cfg.q_lora_rank) if cfg.q_lora_rank is not None else []
        out += norm(f"{prefix}.kv_layernorm", cfg, cfg.kv_lora_rank)
    out.append(Tensor(f"{prefix}.linear_proj.weight", h * part(heads * cfg.v_head_dim, s.tp, s.tp_rank)))
    return out + ([Tensor(f"{prefix}.linear_proj.bias", h)] if not cfg.disable_bias_linear else [])


def moe(prefix: str, cfg: ModelConfig, s: Split) -> list[Tensor]:
    """Router (replicated), this rank's experts (cut over EP, each over expert-TP; --moe-latent-size: in the latent
    width, between two replicated projections), the shared expert."""
    h, f, e = cfg.moe_latent_size or cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts
    width = f * (2 if (cfg.swiglu or cfg.quick_geglu) else 1)
    local = part(e, s.ep, s.ep_rank)
    fc1, fc2 = part(width, s.etp, s.etp_rank), part(f, s.etp, s.etp_rank)
    bias = not cfg.disable_bias_linear
    out = [Tensor(f"{prefix}.router.weight", e * cfg.hidden_size)]
    out.append(Tensor(f"{prefix}.experts.linear_fc1.weight", local * fc1 * h, "edp"))
    out += [Tensor(f"{prefix}.experts.linear_fc1.bias", local * fc1, "edp")] if bias else []
    out.append(Tensor(f"{prefix}.experts.linear_fc2.weight", local * h * fc2, "edp"))
    out += [Tensor(f"{prefix}.experts.linear_fc2.bias", local * h, "edp")] if bias else []
    if cfg.moe_latent_size:  # hidden -> latent before the experts, latent -> hidden after (model/mlp.py)
        for name, rows, cols in (("fc1_latent_proj", h, cfg.hidden_size), ("fc2_latent_proj", cfg.hidden_size, h)):
            out.append(Tensor(f"{prefix}.{name}.weight", rows * cols))
            out += [Tensor(f"{prefix}.{name}.bias", rows)] if bias else []
    if cfg.moe_shared_expert_intermediate_size:  # (a module's own parameters come before its children's)
        out += [Tensor(f"{prefix}.shared_experts.gate_weight", h)] if cfg.moe_shared_expert_gate else []
        out += mlp(f"{prefix}.shared_experts", cfg, cfg.moe_shared_expert_intermediate_size, s)
    return out


def mamba(prefix: str, cfg: ModelConfig, s: Split) -> list[Tensor]:
    """Mamba-2's mixer (model/mamba.py): its own parameters (the convolution, dt_bias, A_log, D) before in_proj,
    the gated norm and out_proj; every block cut over TP by whole heads and groups."""
    heads = mamba_heads(cfg)
    di, bc = heads * cfg.mamba_head_dim, cfg.mamba_num_groups * cfg.mamba_state_dim
    di_r, bc_r, h_r = (part(n, s.tp, s.tp_rank) for n in (di, bc, heads))
    conv = di_r + 2 * bc_r
    return [Tensor(f"{prefix}.conv1d_weight", conv * CONV_WIDTH), Tensor(f"{prefix}.conv1d_bias", conv),
            Tensor(f"{prefix}.dt_bias", h_r), Tensor(f"{prefix}.A_log", h_r), Tensor(f"{prefix}.D", h_r),
            Tensor(f"{prefix}.in_proj.weight", (2 * di_r + 2 * bc_r + h_r) * cfg.hidden_size),
            Tensor(f"{prefix}.norm.weight", di_r), Tensor(f"{prefix}.out_proj.weight", cfg.hidden_size * di_r)]


def gated_delta_net(prefix: str, cfg: ModelConfig, s: Split) -> list[Tensor]:
    """Gated DeltaNet's mixer (model/gated_delta_net.py): the bias-free convolution, dt_bias, A_log, then in_proj,
    the per-head norm (replicated) and out_proj; whole key heads (and the value heads they serve) per TP rank."""
    nk, nv = (part(n, s.tp, s.tp_rank) for n in (cfg.linear_num_key_heads, cfg.linear_num_value_heads))
    qk, v = nk * cfg.linear_key_head_dim, nv * cfg.linear_value_head_dim
    return [Tensor(f"{prefix}.conv1d_weight", (2 * qk + v) * cfg.linear_conv_kernel_dim),
            Tensor(f"{prefix}.dt_bias", nv), Tensor(f"{prefix}.A_log", nv),
            Tensor(f"{prefix}.in_proj.weight", (2 * qk + 2 * v + 2 * nv) * cfg.hidden_size),
            Tensor(f"{prefix}.out_norm.weight", cfg.linear_value_head_dim),
            Tensor(f"{prefix}.out_proj.weight", cfg.hidden_size * v)]


MIXERS = {"attention": attention, "mamba": mamba, "gdn": gated_delta_net}


def layer(cfg: ModelConfig, index: int, kind: tuple, s: Split, prefix: Optional[str] = None) -> list[Tensor]:
    """One decoder layer of ``kind`` (mixer, MLP) (layer_kinds): each part after its own norm."""
    p, (mixer, ffn), out = prefix or f"decoder.layers.{index}", kind, []
    if mixer is not None:
        out += norm(f"{p}.input_layernorm", cfg, cfg.hidden_size) + MIXERS[mixer](f"{p}.self_attention", cfg, s)
    if ffn is not None:
        out += norm(f"{p}.pre_mlp_layernorm", cfg, cfg.hidden_size)
        out += moe(f"{p}.mlp", cfg, s) if ffn == "moe" else mlp(f"{p}.mlp", cfg, cfg.ffn_hidden_size, s)
    return out


def mtp(cfg: ModelConfig, s: Split) -> list[Tensor]:
    """Multi-token prediction's depths on the last stage (model/mtp.py): two norms, the 2h -> h projection (its
    output rows over TP), a layer of the decoder's last layer's kind, a final norm; one set with
    --mtp-use-repeated-layer."""
    h, out, last = cfg.hidden_size, [], layer_kinds(cfg)[-1]
    for k in range(1 if cfg.mtp_use_repeated_layer else cfg.mtp_num_layers):
        p = f"mtp.layers.{k}"
        out += norm(f"{p}.enorm", cfg, h) + norm(f"{p}.hnorm", cfg, h)
        out.append(Tensor(f"{p}.eh_proj.weight", part(h, s.tp, s.tp_rank) * 2 * h))
        out += layer(cfg, cfg.num_layers + k, last, s, prefix=f"{p}.mtp_model_layer")
        out += norm(f"{p}.final_layernorm", cfg, h)
    return out


def moe_pattern(cfg: ModelConfig) -> list[int]:
    """1 where a layer's MLP is MoE, per layer."""
    return [int(k[1] == "moe") for k in layer_kinds(cfg)]


def chunk(cfg: ModelConfig, vocab: int, s: Split, first: int, count: int, pre: bool, post: bool,
          kinds: Optional[list[tuple]] = None) -> list[Tensor]:
    """The parameters of one model chunk (global layers first .. first+count-1) in module order.
    ``vocab``: the padded vocabulary; ``pre``/``post``: the chunk holds the embedding / the output layer;
    ``kinds``: layer_kinds(cfg), when the caller has them."""
    kinds = kinds if kinds is not None else layer_kinds(cfg)
    tied = not cfg.untie_embeddings_and_output_weights
    out = []
    if pre:
        out.append(Tensor(WORD_EMBEDDING, part(vocab, s.tp, s.tp_rank) * cfg.hidden_size,
                          tied="embedding" if tied and not post else None))
        if cfg.position_embedding_type == "learned_absolute":
            out.append(Tensor("embedding.position_embeddings.weight", cfg.max_position_embeddings * cfg.hidden_size))
    for i in range(first, first + count):
        out += layer(cfg, i, kinds[i], s)
    if post:
        out += norm("decoder.final_layernorm", cfg, cfg.hidden_size)
        if not tied or not pre:
            out.append(Tensor("output_layer.weight", part(vocab, s.tp, s.tp_rank) * cfg.hidden_size,
                              tied="embedding" if tied else None))
        if cfg.mtp_num_layers:
            out += mtp(cfg, s)
    return out

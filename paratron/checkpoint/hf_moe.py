"""The mixture-of-experts side of the Hugging Face conversion: Mixtral, Qwen2-MoE, Qwen3-MoE and Qwen3-Next's MoE
blocks; the sigmoid router that DeepSeek-V3 and NemotronH share, and the rows of their experts.

Both families are Llama-style decoders (:mod:`paratron.checkpoint.hf_config` reads and writes their
attention, norms and RoPE as for ``mistral`` and ``qwen3``) whose MLP is, in some or all layers, a
router plus experts. This module holds what is particular to that MLP:

* config.json <-> the ``--num-experts`` / ``--moe-*`` fields of ModelConfig
  (:func:`moe_config_kwargs`, :func:`hf_moe_config`, :func:`check_moe_representable`);
* the rows of the name table for one MoE layer (:func:`moe_layer_rows`) and their two reshapes;
* DeepSeek-V3's and NemotronH's sigmoid router <-> ModelConfig (:func:`sigmoid_router_kwargs`,
  :func:`sigmoid_router_hf_config`, :func:`check_sigmoid_router`);
* :func:`per_expert_state`, which turns the fused expert tensors of transformers 5's in-memory models
  into the per-expert tensors of the checkpoint files.

Router semantics. paratron's router (Megatron's) takes the top-k of the logits and a softmax over
those k (``--moe-router-pre-softmax`` off), or a softmax over all experts and its top-k, not
renormalised (on). Mixtral (softmax over all experts, top-k, divided by their sum) equals the
first; Qwen3-MoE's ``norm_topk_prob: true`` the first, ``false`` the second.

Shared expert. Qwen2-MoE's and Qwen3-Next's MoE blocks add a SwiGLU ``shared_expert`` whose output is scaled by
``sigmoid(shared_expert_gate(x))``, one gate per token: paratron's ``--moe-shared-expert-intermediate-size``
with ``--moe-shared-expert-gate`` (Megatron's SharedExpertMLP with its gate).

Layer placement. Qwen3-MoE's layer i is MoE when i is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; Megatron's ``--moe-layer-freq k`` makes layers 0, k, 2k, ...
MoE. So placements other than "every layer" are written as the explicit 0/1 list that
``--moe-layer-freq`` also accepts, and written back as ``decoder_sparse_step: 1`` plus
``mlp_only_layers``. Mixtral has MoE layers only.
"""
from __future__ import annotations

import re

import torch

from ..config import ModelConfig
from ..config.layer_patterns import parse_moe_layer_freq
from .families import MOE_FAMILIES

__all__ = ["MOE_FAMILIES", "GATED_SHARED",
           "moe_config_kwargs", "hf_moe_config", "check_moe_representable", "moe_layer_rows",
           "sigmoid_router_kwargs", "sigmoid_router_hf_config", "check_sigmoid_router",
           "stack_experts", "unstack_experts", "stack_expert_gate_up", "unstack_expert_gate_up", "per_expert_state"]

# family -> (the MoE block's prefix inside a layer in checkpoint files, expert names of gate, up, down)
_FILE_NAMES = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
               "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
               "qwen2_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
               "deepseek_v3": ("mlp.", ("gate_proj", "up_proj", "down_proj")),  # (hf_deepseek.py: its config)
               "qwen3_next": ("mlp.", ("gate_proj", "up_proj", "down_proj")),  # (hf_hybrid.py: its config)
               "nemotron_h": ("mixer.", (None, "up_proj", "down_proj"))}  # ungated experts (hf_hybrid.py)
# families whose MoE block has a shared expert behind a sigmoid gate (shared_expert, shared_expert_gate)
GATED_SHARED = ("qwen3_next", "qwen2_moe")
# MoE model types paratron does not convert, and the feature that stops it.
REFUSED_MOE = {
    "deepseek_v2": "its routing (softmax scores, group-limited by the best expert of each group) is not mapped; "
                   "deepseek_v3 converts",
    "olmoe": "its q/k norms span all heads (paratron's --qk-layernorm is per head)",
}


def _error(msg: str) -> Exception:
    from .hf_config import ConversionError  # hf_config imports this module
    return ConversionError(msg)


# ----------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ----------------------------------------------------------------------------------------------

def _moe_pattern(d: dict, family: str, num_layers: int) -> list[int]:
    if family == "mixtral":
        return [1] * num_layers
    step = int(d.get("decoder_sparse_step", 1) or 1)
    dense = set(d.get("mlp_only_layers") or [])
    bad = sorted(i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers)
    if bad:
        raise _error(f"qwen3_moe mlp_only_layers {bad} are not layers of a {num_layers}-layer model")
    return [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]


def moe_config_kwargs(d: dict, family: str, num_layers: int) -> dict:
    """The ModelConfig fields of the experts of a Mixtral / Qwen3-MoE config.json (dict)."""
    experts = d.get("num_local_experts", d.get("num_experts"))
    if not experts:
        raise _error(f"{family} config has no experts (num_local_experts / num_experts is {experts!r}); "
                     "a model without experts converts as "
                     + ("mistral" if family == "mixtral" else family.split("_")[0]))
    if float(d.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise _error(f"router_jitter_noise {d['router_jitter_noise']} is not supported: paratron's router has no "
                     "input jitter (set it to 0.0)")
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    if shared and family not in GATED_SHARED:
        raise _error(f"{family} with shared_expert_intermediate_size {shared} is not "
                     "supported: neither Mixtral nor Qwen3-MoE has a shared expert (Qwen2-MoE and Qwen3-Next do)")
    if family in GATED_SHARED and not shared:
        raise _error(f"{family} config has shared_expert_intermediate_size {shared}: its MoE block always has a "
                     "shared expert (transformers builds one); set its size")
    pattern = _moe_pattern(d, family, num_layers)
    if not any(pattern):
        raise _error(f"{family} config places no MoE layer (decoder_sparse_step / mlp_only_layers); "
                     "a model without experts converts as " + family.split("_")[0])
    size_key = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
    if d.get(size_key) is None:
        raise _error(f"config.json has no {size_key!r}")
    gated = dict(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True) if shared else {}
    return dict(
        num_experts=int(experts), moe_router_topk=int(d.get("num_experts_per_tok", 2)),
        moe_ffn_hidden_size=int(d[size_key]), **gated,
        moe_layer_freq="1" if all(pattern) else "[" + ",".join(map(str, pattern)) + "]",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=float(d.get("router_aux_loss_coef", 0.0)),
        moe_router_pre_softmax=family != "mixtral" and not d.get("norm_topk_prob", False))


def hf_moe_config(cfg: ModelConfig, family: str) -> dict:
    """The config.json keys of the experts (cfg resolved and representable in ``family``). The
    number of experts is written under the key transformers 4 reads (5 reads it too)."""
    out = {"num_experts_per_tok": cfg.moe_router_topk, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
           "output_router_logits": False}
    if family == "mixtral":
        out.update(num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_ffn_hidden_size,
                   router_jitter_noise=0.0)
        return out
    pattern = parse_moe_layer_freq(cfg.moe_layer_freq, cfg.num_layers)
    out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_hidden_size,
               norm_topk_prob=not cfg.moe_router_pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    if family in GATED_SHARED:
        out["shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
    return out


def check_moe_representable(cfg: ModelConfig, family: str, need) -> None:
    """``need(cond, what)`` for every MoE setting that ``family`` cannot express (cfg resolved).
    Training-only settings (aux-loss type, z-loss, dispatcher, grouped GEMM, router dtype) do not
    change the network and pass; only router_aux_loss_coef is written."""
    if family not in MOE_FAMILIES + GATED_SHARED:
        need(cfg.num_experts is None, "mixture-of-experts layers (--num-experts): use --family mixtral or qwen3_moe")
        return
    need(cfg.num_experts is not None, "needs --num-experts (a dense model: use "
         + ("mistral or llama)" if family == "mixtral" else family.split("_")[0] + ")"))
    need(cfg.moe_router_score_function == "softmax", "needs --moe-router-score-function softmax")
    need(not cfg.moe_router_enable_expert_bias, "no expert bias (--moe-router-enable-expert-bias)")
    need(cfg.moe_router_topk_scaling_factor is None, "no --moe-router-topk-scaling-factor")
    need(cfg.moe_expert_capacity_factor is None, "dropless routing only (no --moe-expert-capacity-factor)")
    if family in GATED_SHARED:
        need(cfg.moe_shared_expert_intermediate_size is not None and cfg.moe_shared_expert_gate,
             "a shared expert behind a sigmoid gate (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate)")
    else:
        need(cfg.moe_shared_expert_intermediate_size is None, "no shared experts (--moe-shared-expert-intermediate-"
             "size, gated or not)")
    need(cfg.moe_router_load_balancing_type != "sinkhorn", "top-k routing: Sinkhorn routing (--moe-router-load-"
         "balancing-type sinkhorn) weights its experts by sigmoid/softmax scores the HF router does not compute")
    need(cfg.moe_router_group_topk is None, "no group-limited routing (--moe-router-group-topk)")
    need(not cfg.moe_router_force_load_balancing, "no random routing (--moe-router-force-load-balancing)")
    if family == "mixtral":
        need(not cfg.moe_router_pre_softmax, "Mixtral renormalises the top-k probabilities: no "
             "--moe-router-pre-softmax (qwen3_moe with norm_topk_prob false has it)")
        need(all(parse_moe_layer_freq(cfg.moe_layer_freq, cfg.num_layers)),
             "every layer must be MoE (--moe-layer-freq 1); qwen3_moe mixes dense layers")


# ----------------------------------------------------------------------------------------------
# The sigmoid router of DeepSeek-V3 and NemotronH (transformers' DeepseekV3TopkRouter / NemotronHTopkRouter)
# ----------------------------------------------------------------------------------------------

def sigmoid_router_kwargs(d: dict, family: str) -> dict:
    """The router's ModelConfig fields from ``num_experts_per_tok``, ``n_group``, ``topk_group``, ``norm_topk_prob``
    and ``routed_scaling_factor``: sigmoid scores, the ``e_score_correction_bias`` added for choosing only (the
    expert bias), the chosen scores normalised over the top-k and scaled, computed in fp32, no balancing loss.

    paratron (Megatron) normalises the chosen scores when top-k > 1 and never for top-1, where transformers
    normalises by ``norm_topk_prob``: other combinations are refused. Group-limited routing ranks the groups by
    their best 2 biased scores in transformers, by their best top-k / topk_group in Megatron: only a ratio of 2
    agrees."""
    topk, groups, keep = int(d["num_experts_per_tok"]), int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    norm = d.get("norm_topk_prob", True)
    if topk > 1 and not norm:
        raise _error(f"{family} norm_topk_prob false is not supported: paratron normalises sigmoid top-k scores")
    if topk == 1 and norm:
        raise _error(f"{family} norm_topk_prob true with num_experts_per_tok 1 is not supported: transformers then "
                     "weighs the expert by 1, paratron by its sigmoid score (norm_topk_prob false)")
    limited = 1 < groups and keep < groups
    if limited and topk // keep != 2:
        raise _error(f"{family} group-limited routing with num_experts_per_tok {topk} and topk_group {keep} is not "
                     "supported: transformers ranks groups by their best 2 scores, Megatron by the best "
                     "top-k / topk_group")
    return dict(moe_router_topk=topk, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=float(d.get("routed_scaling_factor", 1.0)), moe_router_dtype="fp32",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_router_num_groups=groups if limited else None, moe_router_group_topk=keep if limited else None)


def sigmoid_router_hf_config(cfg: ModelConfig) -> dict:
    """The config.json keys of a sigmoid router (cfg passed :func:`check_sigmoid_router`)."""
    return dict(num_experts_per_tok=cfg.moe_router_topk, norm_topk_prob=cfg.moe_router_topk > 1,
                routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0,
                n_group=cfg.moe_router_num_groups if cfg.moe_router_group_topk else 1,
                topk_group=cfg.moe_router_group_topk or 1)


def check_sigmoid_router(cfg: ModelConfig, need) -> None:
    """``need(cond, what)`` for every router setting a DeepSeek-V3 / NemotronH router cannot express."""
    need(cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias,
         "needs sigmoid routing with an expert bias")
    need(cfg.moe_expert_capacity_factor is None and not cfg.moe_router_force_load_balancing
         and cfg.moe_router_load_balancing_type != "sinkhorn", "dropless top-k routing only")
    need(cfg.moe_router_group_topk is None or cfg.moe_router_topk // cfg.moe_router_group_topk == 2,
         "group-limited routing with --moe-router-topk / --moe-router-group-topk = 2")


# ----------------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------------

def moe_layer_rows(cfg: ModelConfig, family: str) -> list[tuple[str, tuple[str, ...], str]]:
    """The name-table rows of one MoE layer (names inside ``model.layers.{i}.``): the router, fc1 from
    every expert's (gate, up) pair in expert order (its up projection where the experts are not gated:
    NemotronH's), fc2 from every expert's down projection."""
    block, (gate, up, down) = _FILE_NAMES[family]
    experts = range(cfg.num_experts)
    fc1 = tuple(f"{block}experts.{e}.{w}.weight" for e in experts for w in ((up,) if gate is None else (gate, up)))
    fc2 = tuple(f"{block}experts.{e}.{down}.weight" for e in experts)
    rows = [("mlp.router.weight", (f"{block}gate.weight",), "copy"),
            ("mlp.experts.linear_fc1.weight", fc1, "experts" if gate is None else "experts_gate_up"),
            ("mlp.experts.linear_fc2.weight", fc2, "experts")]
    if family in GATED_SHARED:  # the shared expert (a SwiGLU MLP) and its gate
        rows += [("mlp.shared_experts.linear_fc1.weight",
                  (f"{block}shared_expert.{gate}.weight", f"{block}shared_expert.{up}.weight"), "gate_up"),
                 ("mlp.shared_experts.linear_fc2.weight", (f"{block}shared_expert.{down}.weight",), "copy"),
                 ("mlp.shared_experts.gate_weight", (f"{block}shared_expert_gate.weight",), "copy")]
    return rows


def stack_experts(ts: list) -> torch.Tensor:
    """Per-expert [out, in] matrices -> paratron's stacked [experts, out, in]."""
    return torch.stack(ts)


def unstack_experts(t: torch.Tensor) -> list:
    return [w.contiguous() for w in t.unbind(0)]


def stack_expert_gate_up(ts: list) -> torch.Tensor:
    """(gate_0, up_0, gate_1, up_1, ...) -> paratron's experts fc1 [experts, 2 * ffn, hidden], each
    expert's rows ``[gate; up]`` as the dense SwiGLU fc1."""
    return torch.stack([torch.cat([g, u], dim=0) for g, u in zip(ts[0::2], ts[1::2])])


def unstack_expert_gate_up(t: torch.Tensor) -> list:
    out = []
    for w in t.unbind(0):
        out += [part.contiguous() for part in w.chunk(2, dim=0)]
    return out


# transformers 5's in-memory names of fused experts and routers (NemotronH's under mixer., the others' under mlp.)
_FUSED = re.compile(r"^((?:model|backbone)\.layers\.\d+\.)(mlp|mixer)\."
                    r"(experts\.gate_up_proj|experts\.up_proj|experts\.down_proj|gate\.weight)$")


def per_expert_state(hf_state: dict, family: str) -> dict:
    """transformers 5 holds a model's experts fused in memory (``mlp.experts.gate_up_proj``
    [experts, 2 * ffn, hidden] = each expert's [gate; up], ``mlp.experts.down_proj`` [experts, hidden,
    ffn]; Mixtral's router as ``mlp.gate``; NemotronH's ungated ``mixer.experts.up_proj`` [experts, ffn, in] and
    ``mixer.experts.down_proj`` [experts, in, ffn]); its checkpoint files, and transformers 4, have one tensor
    per expert. Returns the state dict with the per-expert (file) names."""
    block, (gate, up, down) = _FILE_NAMES[family]
    memory = "mixer" if family == "nemotron_h" else "mlp"
    fused = ("gate.weight", "experts.down_proj", "experts.up_proj" if gate is None else "experts.gate_up_proj")
    out = {}
    for name, t in hf_state.items():
        m = _FUSED.match(name)
        if m is None or m.group(2) != memory or m.group(3) not in fused:
            out[name] = t
            continue
        layer, _, what = m.groups()
        if what == "gate.weight":
            out[f"{layer}{block}gate.weight"] = t
        elif what in ("experts.down_proj", "experts.up_proj"):
            w = down if what == "experts.down_proj" else up
            out.update((f"{layer}{block}experts.{e}.{w}.weight", x) for e, x in enumerate(unstack_experts(t)))
        else:
            parts = unstack_expert_gate_up(t)
            for e in range(t.shape[0]):
                out[f"{layer}{block}experts.{e}.{gate}.weight"] = parts[2 * e]
                out[f"{layer}{block}experts.{e}.{up}.weight"] = parts[2 * e + 1]
    return out

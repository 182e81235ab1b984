"""torchtitan's DeepSeek-V3 checkpoints in ``paratron convert --from torchtitan --flavor deepseek_v3:FLAVOR``.

Its flavors, its names mapped to Hugging Face DeepSeek-V3's (then paratron/checkpoint/hf_deepseek.py's path) and
what paratron cannot represent.

torchtitan 0.2.2's ``DeepSeekV3Model`` is transformers' DeepSeek-V3 under other names (its own
``DeepSeekV3StateDictAdapter`` renames and splits the stacked experts, nothing else): MLA (``wq`` or the
``wq_a`` / ``q_norm`` / ``wq_b`` pair, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``) rotating the rope dimensions in
interleaved pairs (complex multiplication: HF's ``rope_interleave: true``, paratron's MLA layout: no permutation);
the first ``n_dense_layers`` layers dense, the others MoE (``moe.router.gate``, stacked ``moe.experts.w1/w2/w3``
[experts, out, in], ``moe.shared_experts.w1/w2/w3`` of ``num_shared_experts`` x ``moe_inter_dim``, and with
``load_balance_coeff`` the ``moe.expert_bias`` buffer of auxiliary-loss-free balancing, added to the scores for
choosing only: HF's ``e_score_correction_bias``, paratron's ``mlp.router.expert_bias``, updated at the same rate).
The router reads sigmoid scores, keeps ``num_limited_groups`` of ``num_expert_groups`` groups ranked by their best
two scores, normalises the top-k (``route_norm``) and scales them (``route_scale``) after the experts. YaRN is on
only where the run's ``training.seq_len`` exceeds ``original_seq_len``: ``rope_factor`` with the softmax scale times
``(0.1 mscale ln(rope_factor) + 1)^2`` and unscaled cos / sin (HF's ``mscale`` = ``mscale_all_dim`` = torchtitan's
``mscale``). The sizes (layers, hidden, FFN, latent ranks, experts, shared experts, dense layers) come from the
tensors; heads, head dims, router, norm epsilon and RoPE from the flavor.
"""
from __future__ import annotations

import re

import torch

from ..config import ModelConfig
from .hf_config import ConversionError

# torchtitan 0.2.2's deepseekv3_args (the fields the tensors do not give): n_heads, mscale, moe_args
_SOFT = {"score_func": "softmax", "route_norm": False, "score_before_experts": False}
_FLAVORS = {"debugmodel": (16, 0.7, {**_SOFT, "num_shared_experts": 2, "top_k": 3}),
            "debugmodel_flex_attn": (16, 0.7, {**_SOFT, "num_shared_experts": 2, "top_k": 3}),
            "16B": (16, 0.7, {**_SOFT, "num_shared_experts": 2, "top_k": 6}),
            "236B": (128, 1.0, {**_SOFT, "num_shared_experts": 2, "top_k": 6, "num_expert_groups": 8,
                                "num_limited_groups": 3, "route_scale": 16.0}),
            "671B": (128, 1.0, {"num_shared_experts": 1, "top_k": 8, "num_expert_groups": 8, "num_limited_groups": 4,
                                "score_func": "sigmoid", "route_norm": True, "route_scale": 2.5,
                                "score_before_experts": False})}
FLAVORS = {f"deepseek_v3:{k}": {"n_heads": h, "mscale": m, "moe_args": moe} for k, (h, m, moe) in _FLAVORS.items()}
# DeepSeekV3ModelArgs' / MoEArgs' defaults of the fields read
DEFAULTS = {"n_heads": 16, "norm_eps": 1e-5, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "original_seq_len": 4096, "rope_theta": 10000.0, "rope_factor": 40.0, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "max_seq_len": None,
            "moe_args": {"num_shared_experts": 1, "score_func": "sigmoid", "route_norm": False, "route_scale": 1.0,
                         "gate_bias": False, "score_before_experts": True, "top_k": 1, "num_expert_groups": None,
                         "num_limited_groups": None, "load_balance_coeff": 1e-3}}
_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_LAYER = {**{f"attention.{t}.weight": f"self_attn.{h}.weight" for t, h in _ATTENTION.items()},
          **{f"{t}.{w}.weight": f"{h}.{p}.weight" for t, h in (("feed_forward", "mlp"),
                                                                ("moe.shared_experts", "mlp.shared_experts"))
             for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
          "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "moe.router.gate.weight": "mlp.gate.weight", "moe.expert_bias": "mlp.gate.e_score_correction_bias"}
# (shared with torchtitan.py's Llama-3 / Qwen3 paths)
TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # moe.experts.wN [experts, out, in]


def split_key(k: str) -> tuple:
    """(the match of torchtitan tensor name ``k`` as a layer's, of its rest as stacked experts' ``moe.experts.wN``)."""
    m = re.match(r"^layers\.(\d+)\.(.*)$", k)
    return m, (re.match(r"^moe\.experts\.(w[123])$", m.group(2)) if m is not None else None)


def per_expert(layer: str, which: str, v: torch.Tensor) -> dict:
    """Stacked experts ``moe.experts.wN`` [experts, out, in] of a layer -> Hugging Face's one tensor per expert."""
    return {f"model.layers.{layer}.mlp.experts.{i}.{EXPERT_NAMES[which]}.weight": w for i, w in enumerate(v.unbind(0))}


def _refusal(args: dict, moe: dict, sparse: bool) -> str | None:
    """What of these torchtitan DeepSeek-V3 args paratron cannot represent (None: all of it)."""
    top_k, groups = int(moe["top_k"]), moe.get("num_expert_groups")
    seq = int(args["max_seq_len"])
    for bad, what in (
            (sparse and moe["score_func"] != "sigmoid",
             f"score_func {moe['score_func']!r} (paratron converts DeepSeek-V3's sigmoid router)"),
            (sparse and moe["score_before_experts"], "score_before_experts true (paratron scales expert outputs)"),
            (sparse and moe["gate_bias"], "gate_bias true (paratron's router has no bias)"),
            (sparse and top_k > 1 and not moe["route_norm"],
             f"route_norm false with top_k {top_k} (paratron normalises sigmoid top-k scores)"),
            (sparse and top_k == 1 and moe["route_norm"], "route_norm true with top_k 1 (paratron weighs one "
                                                           "expert by its sigmoid score)"),
            (sparse and groups and int(moe["num_limited_groups"] or 0) < int(groups)
             and top_k // int(moe["num_limited_groups"] or 1) != 2,
             f"num_expert_groups with top_k {top_k} / num_limited_groups {moe['num_limited_groups']} != 2 "
             "(torchtitan ranks groups by their best 2 scores, paratron by the best top_k / num_limited_groups)"),
            (seq > int(args["original_seq_len"]) and float(args["rope_factor"]) < 1.0,
             f"YaRN with rope_factor {args['rope_factor']} < 1")):
        if bad:
            return what
    return None


def _rope(args: dict) -> dict:
    """HF's rope_parameters of the run (YaRN where training.seq_len > original_seq_len, as torchtitan decides)."""
    if int(args["max_seq_len"]) <= int(args["original_seq_len"]):
        return {"rope_type": "default", "rope_theta": float(args["rope_theta"])}
    return {"rope_type": "yarn", "rope_theta": float(args["rope_theta"]), "factor": float(args["rope_factor"]),
            "mscale": float(args["mscale"]), "mscale_all_dim": float(args["mscale"]),
            "original_max_position_embeddings": float(args["original_seq_len"]),
            "beta_fast": float(args["beta_fast"]), "beta_slow": float(args["beta_slow"])}


def deepseek_config(shapes: dict, args: dict) -> tuple[ModelConfig, str]:
    """(paratron's model config, "deepseek_v3") of a torchtitan DeepSeek-V3 checkpoint with these tensor shapes and
    model args (``max_seq_len``: the run's training.seq_len), through the config.json transformers would have."""
    from .hf_config import model_config_from_hf
    moe, heads = args["moe_args"], int(args["n_heads"])
    if args.get("max_seq_len") is None:
        raise ConversionError("--seq-length: torchtitan's DeepSeek-V3 turns YaRN on when training.seq_len exceeds "
                              f"original_seq_len ({args['original_seq_len']}): pass the run's seq_len")
    need = ("tok_embeddings.weight", "layers.0.attention.wkv_a.weight", "layers.0.attention.kv_norm.weight",
            "layers.0.attention.wkv_b.weight", "output.weight")
    missing = [k for k in need if k not in shapes]
    if missing:
        raise ConversionError(f"not a torchtitan DeepSeek-V3 checkpoint: no {missing[0]!r}")
    layers = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"^layers\.(\d+)\.", k))})
    sparse = [i for i in layers if f"layers.{i}.moe.experts.w1" in shapes]
    what = _refusal(args, moe, bool(sparse)) or next((f"a router bias ({k})" for k in shapes
                                                      if k.endswith("moe.router.gate.bias")), None)
    if what:
        raise ConversionError(f"this torchtitan DeepSeek-V3 checkpoint has {what}")
    nope, rope, v = (int(args[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    kv_rank = shapes["layers.0.attention.kv_norm.weight"][0]
    q = shapes.get("layers.0.attention.wq_b.weight") or shapes.get("layers.0.attention.wq.weight")
    got = (q[0] if q else None, *(shapes[f"layers.0.attention.{w}.weight"][0] for w in ("wkv_a", "wkv_b")))
    if got != (heads * (nope + rope), kv_rank + rope, heads * (nope + v)):
        raise ConversionError(f"the tensors do not fit {heads} heads of qk_nope_head_dim {nope}, qk_rope_head_dim "
                              f"{rope} and v_head_dim {v} (wq rows, wkv_a rows, wkv_b rows {got}): pass the flavor")
    dense = [i for i in layers if i not in sparse]
    if dense != layers[:len(dense)]:
        raise ConversionError(f"MoE layers {sparse} do not follow all the dense ones {dense}")
    q_a = shapes.get("layers.0.attention.wq_a.weight")
    d = {"model_type": "deepseek_v3", "vocab_size": shapes["tok_embeddings.weight"][0],
         "hidden_size": shapes["tok_embeddings.weight"][1], "num_hidden_layers": len(layers),
         "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_a[0] if q_a else None,
         "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
         "rms_norm_eps": float(args["norm_eps"]), "rope_parameters": _rope(args), "rope_interleave": True,
         "max_position_embeddings": int(args["max_seq_len"]), "attention_bias": False, "hidden_act": "silu",
         "tie_word_embeddings": False, "first_k_dense_replace": len(dense), "n_routed_experts": None,
         "intermediate_size": shapes[f"layers.{dense[0]}.feed_forward.w1.weight"][0] if dense else 1}
    if sparse:
        w1, i = shapes[f"layers.{sparse[0]}.moe.experts.w1"], sparse[0]
        shared = shapes.get(f"layers.{i}.moe.shared_experts.w1.weight", (0,))[0]
        groups, keep = moe.get("num_expert_groups"), moe.get("num_limited_groups")
        d.update(n_routed_experts=w1[0], moe_intermediate_size=w1[1], n_shared_experts=shared // w1[1],
                 num_experts_per_tok=int(moe["top_k"]), norm_topk_prob=bool(moe["route_norm"]),
                 routed_scaling_factor=float(moe["route_scale"]), n_group=int(groups or 1),
                 topk_group=int(keep or groups or 1))
    cfg, _, family = model_config_from_hf(d)
    if sparse:  # torchtitan's load_balance_coeff: the expert bias's step (none: the bias stays at 0)
        import dataclasses
        cfg = dataclasses.replace(cfg, moe_router_bias_update_rate=float(moe["load_balance_coeff"] or 0.0))
    return cfg, family


def deepseek_to_hf(state: dict, cfg: ModelConfig) -> dict:
    """torchtitan DeepSeek-V3 tensors -> Hugging Face DeepSeek-V3 names (RoPE already interleaved as HF's
    ``rope_interleave``: no permutation), the stacked experts one per expert; an MoE layer without ``expert_bias``
    (``load_balance_coeff`` None, or optimizer moments) gets a zero ``e_score_correction_bias``."""
    out, moe_layers = {}, set()
    for k, v in state.items():
        m, e = split_key(k)
        if m is None and k in TOP:
            out[TOP[k]] = v
        elif e is not None:
            moe_layers.add(m.group(1))
            out.update(per_expert(m.group(1), e.group(1), v))
        elif m is not None and m.group(2) in _LAYER:
            out[f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"] = v
        elif not k.endswith("moe.tokens_per_expert"):
            raise ConversionError(f"torchtitan tensor {k!r} has no place in a DeepSeek-V3 model (another model type?)")
    for i in moe_layers:
        out.setdefault(f"model.layers.{i}.mlp.gate.e_score_correction_bias", torch.zeros(cfg.num_experts))
    return out

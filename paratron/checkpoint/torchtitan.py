"""torchtitan's training checkpoints of its Llama-3, Qwen3 (dense and MoE) and DeepSeek-V3 models, read into paratron
(``paratron convert --from torchtitan``): the weights, and Adam's state, step and the run's position, so that
``--load`` resumes the run.

torchtitan (0.2.x) saves ``{dump_folder}/checkpoint/step-{N}/`` with ``torch.distributed.checkpoint``: every
tensor whole (global), the model's under their module names (``tok_embeddings.weight``,
``layers.{i}.attention.wq.weight``, ...), AdamW's state flattened as ``optimizer.state.{name}.{exp_avg|exp_avg_sq|
step}``, and byte objects for the LR scheduler (``lr_scheduler``: LambdaLR's ``last_epoch``), the data loader and
the train state (``train_state``: ``step``, ``ntokens_seen``). A model-only save (``last_save_model_only``, or a
``--checkpoint.initial_load_path`` export) holds the model alone.

The model's shape is not in the checkpoint (torchtitan reads it from its ``model.flavor``); paratron takes the
flavor (torchtitan's ``llama3_args`` table, below: heads, KV heads, RoPE base, norm epsilon) and reads the sizes
(layers, hidden, FFN, vocabulary) off the tensors. torchtitan's Llama-3 rotates interleaved pairs of each head's
channels (complex multiplication) where paratron, Megatron and Hugging Face rotate the two halves: ``wq`` / ``wk``
rows are permuted as Hugging Face's converter of Meta's weights does; its RoPE always carries Llama-3.1's frequency
scaling (factor 8, low 1, high 4, 8192 positions: ``--use-rope-scaling --rope-scaling-factor 8``). Qwen3 rotates
halves already and has no scaling; its stacked experts [experts, out, in] are split per expert. Weights and moments
then take the Hugging Face Llama / Qwen3 / Qwen3-MoE path (paratron/checkpoint/hf.py), which only moves elements.
DeepSeek-V3 (MLA, sigmoid-routed MoE with its expert bias): paratron/checkpoint/torchtitan_deepseek.py.
"""
from __future__ import annotations

import dataclasses
import re
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from ..config import ModelConfig
from .hf_config import ConversionError
from .pieces import read_objects
from .torchtitan_deepseek import DEFAULTS as _DEEPSEEK, FLAVORS as _DEEPSEEK_FLAVORS
from .torchtitan_deepseek import TOP, deepseek_config, deepseek_to_hf, per_expert, split_key

# torchtitan 0.2.2's flavors ("name:flavor"; a bare flavor is llama3's): the model args the tensors do not give
_LLAMA3 = {"debugmodel": (16, None, 500000.0), "debugmodel_flex_attn": (16, None, 500000.0),
           "debugmodel_varlen_attn": (16, None, 500000.0), "8B": (32, 8, 500000.0), "8B_flex": (32, 8, 500000.0),
           "8B_varlen": (32, 8, 500000.0), "70B": (64, 8, 500000.0), "405B": (128, 8, 500000.0)}
_QWEN3_MOE = {"num_shared_experts": 0, "top_k": 8, "score_func": "softmax", "route_norm": True, "route_scale": 1.0,
              "score_before_experts": False}
_QWEN3 = {"debugmodel": (16, 8, 1e6, True, None), "0.6B": (16, 8, 1e6, True, None), "1.7B": (16, 8, 1e6, True, None),
          "4B": (32, 8, 1e6, True, None), "8B": (32, 8, 1e6, False, None), "14B": (40, 8, 1e6, False, None),
          "32B": (64, 8, 1e6, False, None), "debugmodel_moe": (16, 8, 1e6, False, _QWEN3_MOE),
          "30B-A3B": (32, 4, 1e6, False, _QWEN3_MOE), "235B-A22B": (64, 4, 5e6, False, _QWEN3_MOE)}
FLAVORS = {**{f"llama3:{k}": {"n_heads": h, "n_kv_heads": kv, "rope_theta": t} for k, (h, kv, t) in _LLAMA3.items()},
           **{f"qwen3:{k}": {"n_heads": h, "n_kv_heads": kv, "rope_theta": t, "enable_weight_tying": tie,
                             **({"moe_args": moe} if moe else {})} for k, (h, kv, t, tie, moe) in _QWEN3.items()},
           **_DEEPSEEK_FLAVORS}
# torchtitan's defaults of the fields read (TransformerModelArgs / Qwen3ModelArgs / MoEArgs)
_DEFAULTS = {"llama3": {"n_kv_heads": None, "rope_theta": 10000.0, "norm_eps": 1e-5, "rope_scaling_args": {}},
             "qwen3": {"n_kv_heads": 8, "head_dim": 128, "rope_theta": 1e6, "norm_eps": 1e-6, "qk_norm": True,
                       "enable_weight_tying": False,
                       "moe_args": {"num_shared_experts": 1, "score_func": "sigmoid", "route_norm": False,
                                    "route_scale": 1.0, "score_before_experts": True, "top_k": 1,
                                    "num_expert_groups": None, "gate_bias": False}},
             "deepseek_v3": _DEEPSEEK}
_SIZES = {"dim", "n_layers", "vocab_size", "multiple_of", "ffn_dim_multiplier", "max_seq_len", "hidden_dim",
          "moe_enabled", "moe_inter_dim", "inter_dim", "n_dense_layers", "q_lora_rank", "kv_lora_rank", "attn_type",
          "attn_mask_type", "max_batch_size"}  # (the tensors give them, or they do not change the model)
_STEP = re.compile(r"^step-(\d+)$")
_STATES = ("exp_avg", "exp_avg_sq")
# torchtitan's name inside a layer -> Hugging Face Llama's
_LAYER = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}


def step_dir(root, step: Optional[int] = None) -> Path:
    """The ``step-N`` directory of ``root`` (a ``step-N`` directory itself, torchtitan's ``checkpoint`` folder or its
    dump folder): ``step``'s, else the highest."""
    root = Path(root)
    if _STEP.match(root.name):
        return root
    folder = root / "checkpoint" if (root / "checkpoint").is_dir() else root
    steps = {int(m.group(1)): p for p in folder.glob("step-*") if (m := _STEP.match(p.name)) and p.is_dir()}
    if not steps:
        raise ConversionError(f"{root} holds no torchtitan checkpoint (no step-N directory)")
    if step is not None and step not in steps:
        raise ConversionError(f"{folder} has no step-{step} (it has {', '.join(map(str, sorted(steps)))})")
    return steps[step if step is not None else max(steps)]


def refuse_torchtitan(root: Path) -> None:
    """A torchtitan checkpoint where paratron's own is looked for (``--load``): one line naming the conversion."""
    try:
        d = step_dir(root)
    except ConversionError:
        return
    if (d / ".metadata").is_file():
        from .pieces import CheckpointError
        raise CheckpointError(f"{root} holds torchtitan's checkpoint {d.name}: convert it first, then --load the "
                              f"result: paratron convert --from torchtitan --input {root} --flavor [NAME:]FLAVOR "
                              "--seq-length N --save NEW_DIR")


def model_args(flavor: Optional[str], overrides: Optional[dict]) -> dict:
    """torchtitan's model args that the tensors do not give (and ``name``: llama3 or qwen3): its defaults, the
    flavor's (``--flavor [NAME:]FLAVOR`` from torchtitan 0.2.2's tables), then ``overrides`` (``--model-args``
    JSON: a custom flavor's fields, ``name`` among them)."""
    overrides = dict(overrides or {})
    name = overrides.pop("name", None) or (flavor.split(":")[0] if flavor and ":" in flavor else "llama3")
    if name not in _DEFAULTS:
        raise ConversionError(f"torchtitan model {name!r}: paratron reads llama3, qwen3 and deepseek_v3")
    key = flavor if flavor is None or ":" in flavor else f"llama3:{flavor}"
    if flavor is None and not overrides.get("n_heads"):
        raise ConversionError("--from torchtitan needs the model's flavor: --flavor [NAME:]FLAVOR (e.g. 8B, "
                              "qwen3:30B-A3B) or --model-args '{\"name\": \"qwen3\", \"n_heads\": N, ...}'")
    if key is not None and key not in FLAVORS:
        raise ConversionError(f"--flavor {flavor!r}: torchtitan's flavors are {', '.join(FLAVORS)}; give a custom "
                              "one's fields with --model-args")
    known = set(_DEFAULTS[name]) | {"n_heads"}
    unknown = sorted(set(overrides) - known - _SIZES)
    if unknown:
        raise ConversionError(f"--model-args: {', '.join(unknown)} is not a field paratron reads (it reads "
                              f"{', '.join(sorted(known))}; the sizes come from the tensors)")
    args = {**_DEFAULTS[name], **(FLAVORS[key] if key else {}), **{k: v for k, v in overrides.items() if k in known}}
    args["moe_args"] = {**_DEFAULTS[name].get("moe_args", {}), **(args.get("moe_args") or {})}
    return {**args, "name": name}


def model_config(shapes: dict, args: dict) -> ModelConfig:
    """paratron's model config of a torchtitan Llama-3 checkpoint with these tensor shapes and model args."""
    need = ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
            "layers.0.feed_forward.w1.weight", "output.weight")
    missing = [k for k in need if k not in shapes]
    if missing:
        raise ConversionError(f"not a torchtitan Llama-3 checkpoint: no {missing[0]!r}")
    heads = int(args["n_heads"])
    kv_heads = int(args.get("n_kv_heads") or heads)
    hidden = shapes["tok_embeddings.weight"][1]
    layers = len({int(m.group(1)) for k in shapes if (m := re.match(r"^layers\.(\d+)\.", k))})
    if hidden % heads or shapes["layers.0.attention.wk.weight"][0] != kv_heads * (hidden // heads):
        raise ConversionError(f"the tensors do not fit {heads} heads and {kv_heads} KV heads (hidden {hidden}, "
                              f"wk {shapes['layers.0.attention.wk.weight'][0]} rows): pass the run's flavor")
    rope = {"scaling_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, **(args.get("rope_scaling_args") or {})}
    factor = float(rope["scaling_factor"])
    fixed = (float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
             int(rope["original_max_position_embeddings"]))
    if factor != 1.0 and fixed != (1.0, 4.0, 8192):
        raise ConversionError(f"rope_scaling_args {rope}: paratron's Llama-3.1 scaling fixes low_freq_factor 1, "
                              "high_freq_factor 4 and original_max_position_embeddings 8192 (any scaling_factor)")
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=shapes["layers.0.feed_forward.w1.weight"][0],
        num_attention_heads=heads, group_query_attention=kv_heads != heads, num_query_groups=kv_heads,
        kv_channels=hidden // heads, normalization="RMSNorm", norm_epsilon=float(args["norm_eps"]), swiglu=True,
        disable_bias_linear=True, position_embedding_type="rope", rotary_base=float(args["rope_theta"]),
        use_rope_scaling=factor != 1.0, rope_scaling_factor=factor if factor != 1.0 else 8.0,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0).resolved()


def _rotate_half_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``wq`` / ``wk`` (one block of head_dim rows per head, RoPE pairs interleaved) -> each head's rows as
    [first of each pair; second of each pair] (rotate-half's layout)."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_hf(state: dict, cfg: ModelConfig) -> dict:
    """torchtitan Llama-3 tensors (model names) -> Hugging Face Llama's names and RoPE layout."""
    out = {}
    for k, v in state.items():
        m = re.match(r"^layers\.(\d+)\.(.*)$", k)
        if m is None and k in TOP:
            out[TOP[k]] = v
        elif m is not None and m.group(2) in _LAYER:
            name = _LAYER[m.group(2)]
            if name == "self_attn.q_proj.weight":
                v = _rotate_half_rows(v, cfg.num_attention_heads)
            elif name == "self_attn.k_proj.weight":
                v = _rotate_half_rows(v, cfg.num_query_groups)
            out[f"model.layers.{m.group(1)}.{name}"] = v
        else:
            raise ConversionError(f"torchtitan tensor {k!r} has no place in a Llama-3 model (another model type?)")
    return out


_QWEN3_LAYER = {**_LAYER, "attention.q_norm.weight": "self_attn.q_norm.weight",
                "attention.k_norm.weight": "self_attn.k_norm.weight", "moe.router.gate.weight": "mlp.gate.weight"}


def qwen3_config(shapes: dict, args: dict) -> tuple[ModelConfig, str]:
    """(paratron's model config, Hugging Face family) of a torchtitan Qwen3 checkpoint: through the config.json
    transformers' Qwen3 / Qwen3-MoE would have (paratron/checkpoint/hf_config.py reads it)."""
    from .hf_config import model_config_from_hf
    moe, heads = args["moe_args"], int(args["n_heads"])
    layers = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"^layers\.(\d+)\.", k))})
    sparse = [i for i in layers if f"layers.{i}.moe.experts.w1" in shapes]
    problems = [what for bad, what in (
        (not args.get("qk_norm"), "qk_norm off (paratron's Qwen3 has q_norm / k_norm)"),
        (sparse and moe.get("score_func") != "softmax", f"score_func {moe.get('score_func')!r} (softmax only)"),
        (sparse and (moe.get("num_shared_experts") or moe.get("num_expert_groups") or moe.get("gate_bias")
                     or moe.get("score_before_experts") or float(moe.get("route_scale", 1.0)) != 1.0),
         "shared experts, expert groups, a router bias, scores before the experts or route_scale != 1")) if bad]
    if problems:
        raise ConversionError(f"this torchtitan Qwen3 checkpoint has {problems[0]}")
    dense = [i for i in layers if i not in sparse]
    d = {"model_type": "qwen3_moe" if sparse else "qwen3", "vocab_size": shapes["tok_embeddings.weight"][0],
         "hidden_size": shapes["tok_embeddings.weight"][1], "num_hidden_layers": len(layers),
         "num_attention_heads": heads, "num_key_value_heads": int(args.get("n_kv_heads") or heads),
         "head_dim": int(args["head_dim"]), "rms_norm_eps": float(args["norm_eps"]),
         "intermediate_size": shapes[f"layers.{dense[0]}.feed_forward.w1.weight"][0] if dense else 1,
         "rope_parameters": {"rope_type": "default", "rope_theta": float(args["rope_theta"])},
         "max_position_embeddings": int(args.get("max_seq_len") or 4096), "attention_bias": False,
         "tie_word_embeddings": "output.weight" not in shapes}
    if sparse:
        w1 = shapes[f"layers.{sparse[0]}.moe.experts.w1"]
        d.update(num_experts=w1[0], moe_intermediate_size=w1[1], num_experts_per_tok=int(moe["top_k"]),
                 norm_topk_prob=bool(moe["route_norm"]), decoder_sparse_step=1, mlp_only_layers=dense)
    cfg, _, family = model_config_from_hf(d)
    return cfg, family


def qwen3_to_hf(state: dict) -> dict:
    """torchtitan Qwen3 tensors -> Hugging Face Qwen3 / Qwen3-MoE names (RoPE already rotate-half: no permutation),
    the stacked experts one per expert."""
    out = {}
    for k, v in state.items():
        m, e = split_key(k)
        if m is None and k in TOP:
            out[TOP[k]] = v
        elif e is not None:
            out.update(per_expert(m.group(1), e.group(1), v))
        elif m is not None and m.group(2) in _QWEN3_LAYER:
            out[f"model.layers.{m.group(1)}.{_QWEN3_LAYER[m.group(2)]}"] = v
        elif not k.endswith(("moe.tokens_per_expert", "moe.expert_bias")):  # (read() checks the bias is 0)
            raise ConversionError(f"torchtitan tensor {k!r} has no place in a Qwen3 model (another model type?)")
    return out


def read(root, args: dict, step: Optional[int] = None) -> tuple:
    """(model config, {"model" / "exp_avg" / "exp_avg_sq": paratron state (TP 1, whole tensors)}, vocabulary,
    step directory, {adam_step, step, ntokens_seen}) of a torchtitan checkpoint (no moments in a model-only save)."""
    from . import sharded
    from .hf import hf_to_paratron
    d = step_dir(root, step)
    shapes = sharded.tensor_shapes(d)
    model_keys = [k for k in shapes if not k.startswith(("optimizer.", "lr_scheduler.", "dataloader.",
                                                         "train_state.")) and not k.endswith("tokens_per_expert")]
    if args.get("enable_weight_tying"):  # (torchtitan's state dict names the tied weight twice; its optimizer, once)
        model_keys = [k for k in model_keys if k != "output.weight"]
    sizes = {k: shapes[k][0] for k in model_keys}
    if args["name"] == "qwen3":
        cfg, family = qwen3_config(sizes, args)
        convert = qwen3_to_hf
    elif args["name"] == "deepseek_v3":
        cfg, family = deepseek_config(sizes, args)
        convert = partial(deepseek_to_hf, cfg=cfg)
    else:
        cfg, family = model_config(sizes, args), "llama"
        convert = partial(to_hf, cfg=cfg)
    vocab = shapes["tok_embeddings.weight"][0][0]
    params = [k for k in model_keys if not k.endswith("moe.expert_bias")]  # (a buffer: no moments)
    moments = {s: {k: f"optimizer.state.{k}.{s}" for k in params} for s in _STATES}
    has_optim = all(n in shapes for names in moments.values() for n in names.values())
    wanted = model_keys + ([n for names in moments.values() for n in names.values()] if has_optim else [])
    full = sharded.load_full(d, wanted)
    if args["name"] != "deepseek_v3":
        _no_expert_bias(full)
    out = {"model": hf_to_paratron(convert({k: full[k] for k in model_keys}), cfg, family, vocab, vocab)}
    if has_optim:
        for s, names in moments.items():
            moment = hf_to_paratron(convert({k: full[n] for k, n in names.items()}), cfg, family, vocab, vocab)
            out[s] = {k: v for k, v in moment.items() if not k.endswith("router.expert_bias")}
    state = read_objects(d, [k for k in ("train_state.step", "train_state.ntokens_seen") if k in _names(d)])
    info = {"adam_step": _adam_step(d, shapes, params) if has_optim else None,
            "step": state.get("train_state.step"), "ntokens_seen": state.get("train_state.ntokens_seen")}
    return cfg, out, vocab, d, info


def _no_expert_bias(tensors: dict) -> None:
    """torchtitan's MoE keeps an ``expert_bias`` buffer (auxiliary-loss-free load balancing, ``load_balance_coeff``)
    that its Qwen3 training leaves at zero: dropped then; a trained bias would route otherwise than paratron's
    Qwen3-MoE, so it stops the conversion."""
    trained = [k for k, v in tensors.items() if k.endswith("moe.expert_bias") and bool(v.abs().max() > 0)]
    if trained:
        raise ConversionError(f"{trained[0]} is not zero: auxiliary-loss-free load balancing (torchtitan's "
                              "load_balance_coeff) is not converted yet")


def _run_objects(d: Path, info: dict) -> dict:
    """torchtitan's AdamW param group (one for all parameters: the embedding's) and LambdaLR's state, kept in
    common.json so that ``--to torchtitan`` of this checkpoint, not trained since, writes them back unchanged."""
    group = "optimizer.param_groups.tok_embeddings.weight."
    objects = read_objects(d, sorted(n for n in _names(d) if n.startswith(("lr_scheduler.", group))))
    if not objects or any(v is None for v in objects.values()):
        return {}
    return {"param_group": {k[len(group):]: v for k, v in objects.items() if k.startswith(group)},
            "lr_scheduler": {k[len("lr_scheduler."):]: v for k, v in objects.items() if k.startswith("lr_")},
            "ntokens_seen": info["ntokens_seen"]}


def _names(d: Path) -> set:
    from .pieces import SafeReader
    return set(SafeReader(str(d)).read_metadata().state_dict_metadata)


def _adam_step(d: Path, shapes: dict, model_keys: list[str]) -> int:
    """AdamW's step count (torchtitan keeps one per parameter; they are equal)."""
    from . import sharded
    names = [f"optimizer.state.{k}.step" for k in model_keys if f"optimizer.state.{k}.step" in shapes]
    if not names:
        raise ConversionError(f"{d} has Adam's moments but no step count (optimizer.state.*.step)")
    steps = {float(t.item()) for t in sharded.load_full(d, names).values()}
    if len(steps) != 1:
        raise ConversionError(f"{d}: the parameters have different Adam step counts {sorted(steps)}")
    return int(steps.pop())


def convert(input, save, flavor: Optional[str] = None, model_args_json: Optional[str] = None,
            seq_length: Optional[int] = None, step: Optional[int] = None, force: bool = False, log=None) -> list[str]:
    """torchtitan checkpoint ``input`` -> paratron checkpoint ``save`` (whole tensors: any layout loads it): the
    weights, and from a full checkpoint Adam's moments and step, the iteration and the samples seen (``ntokens_seen``
    / ``seq_length``), so that ``--load save`` resumes the run; returns the model flags to train it with."""
    import json
    from ..config import Config, DataConfig
    from ..parallel.dims import ParallelDims
    from . import sharded
    from .convert import _PARATRON_CKPT_FILES, _Log, _check_output, _print_command, _write_staged
    from .state import layout
    log = log or _Log(True)
    save = Path(save)
    try:
        overrides = json.loads(model_args_json) if model_args_json else None
    except json.JSONDecodeError as e:
        raise ConversionError(f"--model-args is not JSON ({e.msg}): pass e.g. '{{\"n_heads\": 32}}'") from None
    args = model_args(flavor, overrides)
    if args["name"] == "deepseek_v3" and seq_length:  # (training.seq_len: YaRN is on above original_seq_len)
        args["max_seq_len"] = int(seq_length)
    old = _check_output(save, _PARATRON_CKPT_FILES, force, "a paratron checkpoint", "--save")
    cfg, states, vocab, d, info = read(input, args, step)
    if seq_length:  # (the printed command's)
        cfg = dataclasses.replace(cfg, seq_length=int(seq_length), max_position_embeddings=int(seq_length)).resolved()
    it = int(info["step"] if info["step"] is not None else _STEP.match(d.name).group(1))
    optim = "exp_avg" in states
    if optim and not seq_length:
        raise ConversionError("--seq-length: torchtitan's training.seq_len is needed to count the samples the run "
                              f"has seen ({info['ntokens_seen']} tokens at step {it})")
    samples = int(info["ntokens_seen"] or 0) // int(seq_length or 1)
    tensors = {f"model.{k}": v.float().contiguous() for k, v in states["model"].items()}
    for s in _STATES if optim else ():
        tensors.update({f"optimizer.{s}.{k}": v.float().contiguous() for k, v in states[s].items()})
    common = {"consumed_samples": samples if optim else 0, "skipped_iterations": 0,
              "scheduler": {"num_steps": samples} if optim else None,
              "optimizer": {"step": info["adam_step"], "scaler": {"scale": 1.0}} if optim else None, "rng": False,
              "layout": layout(ParallelDims(), None), "config": Config(model=cfg, data=DataConfig(vocab_size=vocab))
              .to_dict(), "converted_from": {"torchtitan": str(d.resolve()), "step": it,
                                              **({"torchtitan_state": _run_objects(d, info)} if optim else {})}}
    log(f"read {d} (step {it}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary {vocab}"
        + (f", Adam's state at step {info['adam_step']}, {samples} samples seen)" if optim else ", model only)"))
    log(f"writing a paratron checkpoint (iteration {it if optim else 0}"
        f"{', with the optimizer state' if optim else ', model weights only'}) to {save}")
    _write_staged(save, old, lambda tmp: sharded.save_full(tmp, it if optim else 0, tensors, common),
                  last=sharded.LATEST)
    flags = _print_command(cfg, 1, save, "pretrain_gpt.py", log)
    if optim:
        log("that command fine-tunes; drop --finetune to resume the run (iteration, samples seen, Adam's state; the "
            "LR schedule and the data order are this command line's, at the samples seen)")
    return flags

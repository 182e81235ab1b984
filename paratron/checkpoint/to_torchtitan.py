"""A paratron checkpoint written as torchtitan 0.2.2's own training checkpoint (``paratron convert --to torchtitan``),
so that torchtitan's ``CheckpointManager`` resumes the run: Llama-3, Qwen3 (dense and MoE) and DeepSeek-V3 models.

What torchtitan's loader asks for (paratron/checkpoint/torchtitan.py reads the same files the other way):
``{output}/checkpoint/step-{N}/`` through ``torch.distributed.checkpoint``, every tensor whole and float32:

* the model's tensors at the top level under torchtitan's module names (``tok_embeddings.weight``,
  ``layers.{i}.attention.wq.weight``, a Qwen3 MoE's stacked ``layers.{i}.moe.experts.w1`` [experts, out, in] and, when
  the flavor balances the load (``load_balance_coeff``, 1e-3 by default), its ``moe.expert_bias`` buffer: zeros, as
  torchtitan's Qwen3 training leaves it); a tied model (``enable_weight_tying``) has ``output.weight`` too, the same
  tensor; DeepSeek-V3's ``moe.expert_bias`` is paratron's router's; the vocabulary is unpadded (the embedding has
  exactly ``vocab_size`` rows);
* ``optimizer``: AdamW's state as torchtitan's ``OptimizersContainer`` flattens it (``state.{name}.exp_avg``,
  ``exp_avg_sq`` and the 0-d float32 ``step``; a tied output has none) and ``param_groups.{name}.{lr, betas, eps,
  weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused, decoupled_weight_decay, initial_lr}``
  (torch's AdamW group, ``fused`` as torchtitan's default implementation): torch's ``load_state_dict`` takes these
  for the resumed optimizer, so ``lr`` is the LR of the next step;
* ``lr_scheduler``: LambdaLR's state (``last_epoch`` = the step; torchtitan's own lambda gives the later LRs);
* ``train_state``: ``step`` and ``ntokens_seen`` (samples seen x sequence length).

Torchtitan's data loader state is not written: paratron's data order is not torchtitan's. Its loader is strict, so
the run that resumes passes ``--checkpoint.exclude_from_loading dataloader`` (its data then start from the data set's
beginning). A checkpoint without Adam's state is written as ``step-0``, which torchtitan loads as model weights only.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Optional

import torch

from .hf_config import ConversionError
from . import torchtitan as T
from . import torchtitan_deepseek as DS
from .torchtitan_deepseek import EXPERT_NAMES, TOP

_HF_TOP = {hf: tt for tt, hf in TOP.items()}
_HF_LAYER = {hf: tt for tt, hf in T._QWEN3_LAYER.items()}
_HF_EXPERT = {hf: tt for tt, hf in EXPERT_NAMES.items()}
_HF_DEEPSEEK = {hf: tt for tt, hf in DS._LAYER.items()}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# torchtitan 0.2.2's flavors' sizes (the reader's FLAVORS table has the rest): dim, n_layers, vocab_size, and llama3's
# multiple_of / ffn_dim_multiplier or qwen3's hidden_dim, moe_inter_dim and num_experts
_L3 = {"debugmodel": (256, 6, 2048, 256, None), "8B": (4096, 32, 128256, 1024, 1.3),
       "70B": (8192, 80, 128256, 4096, 1.3), "405B": (16384, 126, 128256, 4096, 1.2)}
_Q3 = {"debugmodel": (256, 8, 2048, 3072, None), "0.6B": (1024, 28, 151936, 3072, None),
       "1.7B": (2048, 28, 151936, 6144, None), "4B": (2560, 36, 151936, 9728, None),
       "8B": (4096, 36, 151936, 12288, None), "14B": (5120, 40, 151936, 17408, None),
       "32B": (5120, 64, 151936, 25600, None), "debugmodel_moe": (256, 8, 2048, 3072, (768, 64)),
       "30B-A3B": (2048, 48, 151936, 6144, (768, 128)), "235B-A22B": (4096, 94, 151936, 12288, (1536, 128))}
_L3_VARIANTS = {"debugmodel_flex_attn": "debugmodel", "debugmodel_varlen_attn": "debugmodel", "8B_flex": "8B",
                "8B_varlen": "8B"}
FLAVOR_SIZES = {
    **{f"llama3:{k}": dict(zip(("dim", "n_layers", "vocab_size", "multiple_of", "ffn_dim_multiplier"),
                               _L3[_L3_VARIANTS.get(k, k)])) for k in (*_L3, *_L3_VARIANTS)},
    **{f"qwen3:{k}": {"dim": d, "n_layers": n, "vocab_size": vs, "hidden_dim": h,
                      **({"moe_inter_dim": moe[0], "num_experts": moe[1]} if moe else {})}
       for k, (d, n, vs, h, moe) in _Q3.items()},
    **{f"deepseek_v3:{k}": dict(zip(("dim", "n_layers", "vocab_size", "inter_dim", "moe_inter_dim", "n_dense_layers",
                                     "num_experts", "q_lora_rank", "kv_lora_rank"), v)) for k, v in (
        ("debugmodel", (256, 6, 2048, 1024, 256, 1, 8, 0, 512)),
        ("debugmodel_flex_attn", (256, 6, 2048, 1024, 256, 1, 8, 0, 512)),
        ("16B", (2048, 27, 102400, 10944, 1408, 1, 64, 0, 512)), ("236B", (5120, 60, 102400, 12288, 1536, 1, 160,
                                                                          1536, 512)),
        ("671B", (7168, 61, 129280, 18432, 2048, 3, 256, 1536, 512)))}}
_SIZE_FIELDS = ("dim", "n_layers", "vocab_size", "multiple_of", "ffn_dim_multiplier", "hidden_dim", "moe_inter_dim",
                "inter_dim", "n_dense_layers", "q_lora_rank", "kv_lora_rank")
# torch's AdamW param group as torchtitan builds it (implementation "fused", its default), but LR, betas, eps, decay
# paratron model features torchtitan's Llama-3 / Qwen3 have no counterpart of (their default is off)
_UNEXPRESSED = (("use_mup", "muP's multipliers"), ("attention_output_gate", "an attention output gate"),
                ("experimental_attention_variant", "linear attention"), ("enable_gpt_oss", "gpt-oss's attention"),
                ("rotary_seq_len_interpolation_factor", "RoPE position interpolation"),
                ("moe_expert_capacity_factor", "an expert capacity (token dropping)"),
                ("moe_latent_size", "a MoE latent projection"), ("glu_linear_offset", "a GLU offset"),
                ("activation_func_clamp_value", "a clamped activation"), ("apply_layernorm_1p", "1 + norm weights"),
                ("moe_shared_expert_gate", "a shared-expert gate"))
_GROUP = {"amsgrad": False, "maximize": False, "foreach": False, "capturable": False, "differentiable": False,
          "fused": True, "decoupled_weight_decay": True}


def _interleave_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``wq`` / ``wk`` in rotate-half's layout (each head: the first of each RoPE pair, then the second) ->
    torchtitan's Llama-3 layout (pairs interleaved): the inverse of torchtitan.py's ``_rotate_half_rows``."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def from_hf(hf: dict, cfg, name: str) -> dict:
    """Hugging Face Llama / Qwen3 / Qwen3-MoE / DeepSeek-V3 tensors -> torchtitan's names (Llama-3's wq / wk rows
    interleaved, the experts stacked [experts, out, in])."""
    out, experts = {}, {}
    layer_names = _HF_DEEPSEEK if name == "deepseek_v3" else _HF_LAYER
    for k, v in hf.items():
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", k)
        e = _EXPERT.match(m.group(2)) if m is not None else None
        if m is None and k in _HF_TOP:
            out[_HF_TOP[k]] = v
        elif e is not None:
            experts.setdefault((m.group(1), _HF_EXPERT[e.group(2)]), {})[int(e.group(1))] = v
        elif m is not None and m.group(2) in layer_names:
            tt = layer_names[m.group(2)]
            if name == "llama3" and tt in ("attention.wq.weight", "attention.wk.weight"):
                v = _interleave_rows(v, cfg.num_attention_heads if tt.endswith("wq.weight") else cfg.num_query_groups)
            out[f"layers.{m.group(1)}.{tt}"] = v
        else:
            raise ConversionError(f"{k} has no place in torchtitan's {name} model")
    for (layer, w), by_expert in experts.items():
        out[f"layers.{layer}.moe.experts.{w}"] = torch.stack([by_expert[i] for i in sorted(by_expert)])
    return out


def check_exportable(m, name: str) -> None:
    """What torchtitan's Llama-3 / Qwen3 / DeepSeek-V3 cannot express, by name (the flavor's own values are compared
    later)."""
    from ..config.layer_patterns import parse_moe_layer_freq
    if name not in ("llama3", "qwen3", "deepseek_v3"):
        raise ConversionError(f"--to torchtitan writes llama3, qwen3 and deepseek_v3 models, not {name}")
    moe = parse_moe_layer_freq(m.moe_layer_freq, m.num_layers) if m.num_experts else []
    ds, llama, qwen = name == "deepseek_v3", name == "llama3", name == "qwen3"
    problems = [what for bad, what in (
        (m.model != "gpt", f"--model {m.model}"), (m.hybrid_layer_pattern, "a hybrid layer pattern"),
        (m.mtp_num_layers, "multi-token prediction layers"), (m.normalization != "RMSNorm", f"{m.normalization}"),
        (not m.swiglu, "an MLP other than SwiGLU"), (not m.disable_bias_linear or m.add_qkv_bias, "linear biases"),
        (not ds and m.multi_latent_attention, "multi-latent attention (try deepseek_v3)"),
        (ds and not m.multi_latent_attention, "no multi-latent attention (torchtitan's DeepSeek-V3 has it)"),
        (not ds and m.position_embedding_type != "rope", f"{m.position_embedding_type} positions"),
        (llama and m.qk_layernorm, "q/k norms (torchtitan's Llama-3 has none: try qwen3)"),
        (qwen and not m.qk_layernorm, "no q/k norms (torchtitan's Qwen3 has them: try llama3)"),
        (llama and m.num_experts, "experts (torchtitan's Llama-3 is dense: try qwen3)"),
        (not qwen and not m.untie_embeddings_and_output_weights, f"tied embeddings ({name} unties them)"),
        (qwen and moe and len(set(moe)) != 1, "dense and MoE layers mixed (torchtitan's Qwen3 makes all or none MoE)"),
        (qwen and m.moe_shared_expert_intermediate_size, "a shared expert"),
        (qwen and m.moe_router_num_groups, "expert groups"),
        (not ds and m.softmax_scale not in (None, m.kv_channels ** -0.5), f"--softmax-scale {m.softmax_scale}"),
        *((getattr(m, field), what) for field, what in _UNEXPRESSED)) if bad]
    if problems:
        raise ConversionError(f"torchtitan's {name} cannot express this paratron model: it has {problems[0]}")


def _llama_ffn(dim: int, multiple_of: int, multiplier: Optional[float]) -> int:
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _sizes_of(m, vocab: int, name: str, sizes: dict) -> tuple[dict, dict]:
    """(the flavor's sizes, this model's) under torchtitan's field names, the flavor's derived ones added."""
    from ..config.layer_patterns import parse_moe_layer_freq
    got = {"dim": m.hidden_size, "n_layers": m.num_layers, "vocab_size": vocab}
    moe = parse_moe_layer_freq(m.moe_layer_freq, m.num_layers) if m.num_experts else [0] * m.num_layers
    experts = {"moe_inter_dim": m.moe_ffn_hidden_size if m.num_experts else sizes.get("moe_inter_dim"),
               "num_experts": m.num_experts or sizes.get("num_experts")}
    if name == "llama3" and "dim" in sizes:
        sizes = {**sizes, "ffn": _llama_ffn(sizes["dim"], sizes.get("multiple_of") or 256,
                                            sizes.get("ffn_dim_multiplier"))}
        got["ffn"] = m.ffn_hidden_size
    elif name == "qwen3":
        got.update(hidden_dim=m.ffn_hidden_size if not m.num_experts else sizes.get("hidden_dim"), **experts)
    elif name == "deepseek_v3":
        dense = next((i for i, x in enumerate(moe) if x), len(moe))
        got.update(inter_dim=m.ffn_hidden_size if dense else sizes.get("inter_dim"), n_dense_layers=dense,
                   q_lora_rank=m.q_lora_rank or 0, kv_lora_rank=m.kv_lora_rank, **experts)
    return sizes, got


def check_flavor(m, vocab: int, args: dict, sizes: dict, shapes: dict, label: str) -> None:
    """Refuse, naming every difference, a flavor (``args`` / ``sizes``) that is not this paratron model: its sizes, and
    the config paratron's reader would build from the written tensors with these args (heads, RoPE, norms, MoE)."""
    from ..config import Config, DataConfig
    from .compat import model_differences
    sizes, got = _sizes_of(m, vocab, args["name"], sizes)
    diffs = [(k, sizes[k], got[k]) for k in got if sizes.get(k) is not None and sizes[k] != got[k]]
    if not diffs:
        want = (T.model_config(shapes, args) if args["name"] == "llama3" else T.qwen3_config(shapes, args)[0]
                if args["name"] == "qwen3" else DS.deepseek_config(shapes, args)[0])
        now = Config(model=m, data=DataConfig(vocab_size=vocab))
        diffs = model_differences(Config(model=want, data=DataConfig(vocab_size=vocab)).to_dict(), now)
        if want.moe_router_bias_update_rate != m.moe_router_bias_update_rate and args["name"] == "deepseek_v3":
            diffs.append(("load_balance_coeff", want.moe_router_bias_update_rate, m.moe_router_bias_update_rate))
    if diffs:
        raise ConversionError(f"{label} is not this paratron model: " + ", ".join(
            f"{k} {w} (flavor) vs {g} (checkpoint)" for k, w, g in diffs))


def flavor_args(flavor: Optional[str], model_args_json: Optional[str]) -> tuple[dict, dict, str]:
    """(torchtitan's model args as the reader takes them, the sizes the flavor fixes, a label for messages)."""
    try:
        overrides = json.loads(model_args_json) if model_args_json else {}
    except json.JSONDecodeError as e:
        raise ConversionError(f"--model-args is not JSON ({e.msg}): pass e.g. '{{\"n_heads\": 32}}'") from None
    if flavor is None and not overrides.get("n_heads"):
        raise ConversionError("--to torchtitan needs the torchtitan run's flavor: --flavor [NAME:]FLAVOR (e.g. "
                              "llama3:8B, qwen3:0.6B) or --model-args '{\"name\": \"qwen3\", \"n_heads\": N, ...}'")
    args = T.model_args(flavor, overrides)
    key = None if flavor is None else flavor if ":" in flavor else f"llama3:{flavor}"
    sizes = {**FLAVOR_SIZES.get(key, {}), **{k: v for k, v in overrides.items() if k in _SIZE_FIELDS}}
    if "num_experts" in (overrides.get("moe_args") or {}):
        sizes["num_experts"] = overrides["moe_args"]["num_experts"]
    label = " ".join(x for x in (flavor and f"--flavor {flavor}", model_args_json and "--model-args") if x)
    return args, sizes, label


def _lr_now(cfg, sd: dict) -> float:
    """The LR of paratron's schedule state ``sd`` now (the schedule as saved, at its position)."""
    import dataclasses
    from ..optim.schedule import build_scheduler
    if "decay_steps" not in sd:
        raise ConversionError("the checkpoint has no LR schedule (converted, not trained by paratron): the LR of "
                              "torchtitan's next step is unknown; train at least one iteration, or convert again")
    sched = build_scheduler(cfg, int(sd["decay_steps"]))
    sched.resume(sd, dataclasses.replace(cfg.optim, override_opt_param_scheduler=False,
                                         use_checkpoint_opt_param_scheduler=True))
    return float(sched.lr)


def run_state(cfg, common: dict, it: int) -> tuple[dict, dict, dict]:
    """(AdamW's param group less its params, LambdaLR's state, train_state) torchtitan resumes from: a checkpoint
    converted from torchtitan and not trained since keeps torchtitan's own; else paratron's schedule at its position
    (its peak LR as torchtitan's base LR, the samples seen x the sequence length as the tokens seen)."""
    conv = common.get("converted_from")
    saved = conv.get("torchtitan_state") if isinstance(conv, dict) else None
    if saved and saved.get("param_group") and saved.get("lr_scheduler"):
        group = {**saved["param_group"], "betas": tuple(saved["param_group"]["betas"])}
        tokens = saved.get("ntokens_seen")
        return group, dict(saved["lr_scheduler"]), {"step": it, "ntokens_seen": int(tokens or 0)}
    op = cfg.optim
    lr = _lr_now(cfg, common["scheduler"])
    group = {"lr": lr, "betas": (op.adam_beta1, op.adam_beta2), "eps": op.adam_eps, "weight_decay": op.weight_decay,
             **_GROUP, "initial_lr": op.lr}
    sched = {"base_lrs": [op.lr], "last_epoch": it, "_step_count": it + 1, "_is_initial": False,
             "_get_lr_called_within_step": False, "_last_lr": [lr]}
    tokens = int(common.get("consumed_samples", 0)) * int(cfg.model.seq_length or 0)
    return group, sched, {"step": it, "ntokens_seen": tokens}


def tensors(state: dict, cfg, vocab: int, name: str) -> dict:
    """paratron's whole tensors (a model's, or one Adam moment keyed by the model's names) -> torchtitan's, float32,
    the vocabulary's padding rows dropped."""
    from .hf import paratron_to_hf
    family = ("llama" if name == "llama3" else "deepseek_v3" if name == "deepseek_v3" else
              "qwen3_moe" if cfg.num_experts else "qwen3")
    return {k: v.float().contiguous() for k, v in from_hf(paratron_to_hf(state, cfg, family, vocab), cfg,
                                                          name).items()}


def _read(load, iteration: Optional[int]) -> tuple:
    """(directory, common.json, Config, vocabulary, {name: tensor} of ``model.`` and ``optimizer.``) of a paratron
    checkpoint."""
    from . import sharded
    from .convert import _saved_config
    d = sharded.find_checkpoint(Path(load), group=sharded.SOLO, iteration=iteration)
    if d is None:
        raise ConversionError(f"no paratron checkpoint in {load}")
    common = sharded.read_common(d)
    cfg = _saved_config(common, d)
    if not cfg.data.vocab_size:
        raise ConversionError(f"{d} has no data.vocab_size: the real vocabulary size (torchtitan's vocab_size) is "
                              "unknown")
    shapes = sharded.tensor_shapes(d)
    if cfg.optim.optimizer != "adam" and any(k.startswith("optimizer.") for k in shapes):
        raise ConversionError(f"{d} holds the state of --optimizer {cfg.optim.optimizer}: torchtitan resumes AdamW's "
                              "only (save the weights alone with --no-save-optim, or fine-tune them)")
    full = sharded.load_full(d, [k for k in shapes if k.startswith(("model.", "optimizer."))])
    return d, common, cfg, int(cfg.data.vocab_size), full


def model_tensors(full: dict, cfg, vocab: int, args: dict) -> dict:
    """torchtitan's model tensors (the fp32 main weights where paratron keeps 16-bit ones)."""
    m, name = cfg.model, args["name"]
    model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    masters = {k: full.get(f"optimizer.fp32_param.{k}", v) for k, v in model.items()}
    out = tensors(masters, m, vocab, name)
    if not m.untie_embeddings_and_output_weights:  # (torchtitan's state dict names the shared weight twice)
        out["output.weight"] = out["tok_embeddings.weight"]
    coeff = (args.get("moe_args") or {}).get("load_balance_coeff", 1e-3)
    bias = [k for k in out if k.endswith("moe.expert_bias")]  # (DeepSeek-V3's: paratron's router.expert_bias)
    if coeff is None:  # (torchtitan's model has no bias buffer then: check_flavor refuses a moving one)
        out = {k: v for k, v in out.items() if k not in bias}
    elif m.num_experts and not bias:  # (Qwen3's: zeros, as torchtitan's Qwen3 training leaves it)
        out.update({f"layers.{i}.moe.expert_bias": torch.zeros(m.num_experts) for i in range(m.num_layers)})
    return out


def optimizer_state(full: dict, cfg, vocab: int, args: dict, common: dict, it: int) -> Optional[dict]:
    """``optimizer``, ``lr_scheduler`` and ``train_state`` as torchtitan saves them; None without Adam's state."""
    model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    params = [k for k in model if not k.endswith("router.expert_bias")]  # (a buffer: no moments)
    if common.get("optimizer") is None or not all(f"optimizer.exp_avg.{k}" in full for k in params):
        return None
    moments = {s: tensors({k: full.get(f"optimizer.{s}.{k}", torch.zeros_like(model[k])) for k in model}, cfg.model,
                          vocab, args["name"]) for s in ("exp_avg", "exp_avg_sq")}
    group, sched, train = run_state(cfg, common, it)
    step = torch.tensor(float(common["optimizer"]["step"]))
    opt = {}
    for k in (k for k in moments["exp_avg"] if not k.endswith("moe.expert_bias")):  # (a tied output: no state)
        opt.update({f"state.{k}.exp_avg": moments["exp_avg"][k], f"state.{k}.exp_avg_sq": moments["exp_avg_sq"][k],
                    f"state.{k}.step": step.clone()})
        opt.update({f"param_groups.{k}.{g}": v for g, v in group.items()})
    return {"optimizer": opt, "lr_scheduler": sched, "train_state": train}


def export(load, output, flavor: Optional[str] = None, model_args_json: Optional[str] = None,
           iteration: Optional[int] = None, force: bool = False, log=None) -> Path:
    """paratron checkpoint ``load`` (the latest or ``iteration``'s) -> torchtitan checkpoint in the dump folder
    ``output`` (``checkpoint/step-{N}``), checked against torchtitan's flavor; returns the step directory."""
    from .convert import _Log, _check_output, _write_staged
    log = log or _Log(True)
    args, sizes, label = flavor_args(flavor, model_args_json)
    d, common, cfg, vocab, full = _read(load, iteration)
    check_exportable(cfg.model, args["name"])
    if args["name"] == "deepseek_v3" and not args.get("max_seq_len"):  # (torchtitan's training.seq_len: YaRN's)
        args["max_seq_len"] = cfg.model.seq_length
    state = model_tensors(full, cfg, vocab, args)
    tied = args.get("enable_weight_tying")  # (the reader takes a tied flavor's output.weight for the embedding's)
    check_flavor(cfg.model, vocab, args, sizes, {k: tuple(v.shape) for k, v in state.items()
                                                 if not (tied and k == "output.weight")}, label)
    it = int(common["iteration"])
    rest = optimizer_state(full, cfg, vocab, args, common, it)
    step = it if rest else 0
    out = Path(output)
    old = _check_output(out, re.compile(r"^checkpoint$"), force, "a torchtitan checkpoint folder", "--output")
    what = f"AdamW's state at step {common['optimizer']['step']}" if rest else "model weights only"
    log(f"writing torchtitan's {args['name']} checkpoint of step {step} ({vocab} vocabulary rows, {what}) to "
        f"{out / 'checkpoint' / f'step-{step}'}")
    _write_staged(out, old, lambda tmp: _write(tmp / "checkpoint" / f"step-{step}", {**state, **(rest or {})}))
    resume = (" --checkpoint.exclude_from_loading dataloader (its state is not written)" if rest
              else " (step-0: the weights only)")
    log(f"resume it with torchtitan's trainer: --job.dump_folder {out} --checkpoint.enable --model.name "
        f"{args['name']} --model.flavor {(flavor or 'FLAVOR').split(':')[-1]}{resume}")
    return out / "checkpoint" / f"step-{step}"


def _write(d: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    d.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)

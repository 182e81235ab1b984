"""A paratron checkpoint written as Megatron-LM's own torch_dist checkpoint (``paratron convert --to megatron``), so
that Megatron resumes the run: the weights, and with them Adam's state in the distributed optimizer's
``fully_reshardable`` layout (``--use-distributed-optimizer``; Megatron reads it at any layout), Adam's step, the
LR schedule's position, the iteration and the samples seen.

What Megatron's loader reads (paratron/checkpoint/megatron.py reads the same files the other way):

* ``iter_{N:07d}/`` through ``torch.distributed.checkpoint``: every tensor global, the transformer layers stacked
  along a first dimension (``decoder.layers.{name}`` [layers, ...]; ``decoder.layers.{i}.{name}`` when dense and
  MoE layers mix), the norms under the names Megatron's files use
  for both layer specs (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``), the
  routed experts under ``mlp.experts.experts.`` [layers, experts, ...], a GPT model's MTP layers under
  ``mtp.layers.{k}.transformer_layer.``; each linear layer's ``_extra_state`` as the byte object Megatron writes
  (``{name}/shard_{layer}_{layers}``, per expert ``shard_{layer}.{expert}_{layers}.{experts}``); the optimizer's
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.{name}`` in the same shapes (``param``: the fp32 main weights);
* ``common.pt``: ``args`` (an ``argparse.Namespace`` of paratron's configuration, whose field names are Megatron's
  flag dests, with ``padded_vocab_size`` and the samples seen), ``checkpoint_version`` 3.0, ``iteration``, the
  distributed optimizer's param groups (decayed and not decayed; a MoE's experts in a second, chained optimizer)
  with Adam's step, ``opt_param_scheduler`` and the ``content_metadata`` naming the optimizer's layout;
* ``metadata.json`` (the backends) and ``latest_checkpointed_iteration.txt``.

Megatron's random generator states are not written: Megatron resumes it with ``--no-load-rng``.
"""
from __future__ import annotations

import argparse
import json
import re
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from .hf_config import ConversionError
from . import megatron_hybrid as hybrid
from .megatron import _LAYER, _LAYER_NAMES, _MTP, TRACKER

_CONTENT = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": False,
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def megatron_name(key: str, stacked: bool = True, mla: bool = False) -> tuple[str, Optional[int]]:
    """(Megatron's tensor name, layer index along its stacked first dimension or None) of paratron's ``key``; a
    stack whose layers differ (dense and MoE) is saved one name per layer (``stacked`` False). Megatron's files name
    the norms as Transformer Engine's fused ones, but for multi-latent attention's layers (``mla``)."""
    m, mtp = _LAYER.match(key), _MTP.match(key)
    rest = m.group(3) if m else mtp.group(2) if mtp else None
    if rest is None:
        return key, None
    for ours, theirs in _LAYER_NAMES:
        if rest.startswith(ours) and not (mla and ours.endswith("layernorm.")):
            rest = theirs + rest[len(ours):]
    if mtp:
        return f"{mtp.group(1)}transformer_layer.{rest}", None
    return (f"{m.group(1)}{rest}", int(m.group(2))) if stacked else (f"{m.group(1)}{m.group(2)}.{rest}", None)


def homogeneous(cfg) -> bool:
    """Whether every layer has the same tensors (Megatron then stacks them)."""
    from ..config.layer_patterns import parse_moe_layer_freq
    return not cfg.num_experts or len(set(parse_moe_layer_freq(cfg.moe_layer_freq, cfg.num_layers))) == 1


def stack(state: dict, stacked: bool = True, mla: bool = False) -> dict:
    """paratron's whole tensors (``decoder.layers.{i}.`` one per layer) -> Megatron's names, layers stacked."""
    layers, out = defaultdict(dict), {}
    for k, v in state.items():
        name, i = megatron_name(k, stacked, mla)
        if i is None:
            out[name] = v
        else:
            layers[name][i] = v
    for name, by_layer in layers.items():
        out[name] = torch.stack([by_layer[i] for i in sorted(by_layer)])
    return out


def extra_states(tensors: dict, stacked: bool) -> dict:
    """The ``_extra_state`` object ([None] outside FP8) Megatron writes for each linear layer of ``tensors``
    (Megatron's names): one per stacked layer (``shard_{layer}_{layers}``), per routed expert (``shard_{expert}_
    {experts}``, or both), or one (``shard_0_1``)."""
    out = {}
    for name, t in tensors.items():
        weight = re.match(r"^(.*)\.weight(\.(z|x|B|C|dt))?$", name)  # (a Mamba in_proj's blocks: one module)
        module = weight.group(1) if weight else ""
        if not re.search(r"(^|\.)(linear_\w+|eh_proj|mixer\.(in|out)_proj)$", module):
            continue
        layered = stacked and name.startswith("decoder.layers.")
        experts = ".mlp.experts.experts." in name
        n, e = (t.shape[0] if layered else 1), (t.shape[1 if layered else 0] if experts else 1)
        for i in range(n):
            for j in range(e):
                shard = (f"{i}.{j}_{n}.{e}" if layered and experts else f"{j}_{e}" if experts
                         else f"{i}_{n}")
                out[f"{module}._extra_state/shard_{shard}"] = [None]
    return out


def check_exportable(cfg) -> None:
    """GPT models (dense, MoE, mixed, MLA, MTP) and hybrid stacks of Mamba-2, attention, MLP and MoE layers are
    written; linear attention (Gated DeltaNet) is not (Megatron-LM 0.16's hybrid stack has no such layer)."""
    problems = [what for bad, what in (
        (cfg.experimental_attention_variant or "G" in (cfg.hybrid_layer_pattern or ""), "linear-attention layers"),
        (cfg.model != "gpt", f"--model {cfg.model}")) if bad]
    if problems:
        raise ConversionError(f"--to megatron writes GPT models (dense or MoE, MLA, MTP) and Mamba-2 hybrid stacks; "
                              f"this one has {problems[0]}")


def megatron_tensors(state: dict, cfg, layout: dict) -> dict:
    """paratron's whole tensors (model or optimizer state, keyed by the model's names) -> Megatron's torch_dist
    tensors: a hybrid stack's Mamba layers and final norm by megatron_hybrid, every other layer as GPT's."""
    if not cfg.hybrid_layer_pattern:
        return stack(state, **layout)
    done, rest = hybrid.to_megatron_names(state, cfg.hybrid_layer_pattern, hybrid.mixer_blocks(hybrid.model_args(cfg)))
    return {**done, **stack(rest, **layout)}


def _args(cfg, rows: int, consumed: int, iteration: int) -> argparse.Namespace:
    """Megatron's ``args``: paratron's configuration (its field names are Megatron's flag dests), the dests Megatron
    stores under other names, and what its loader reads besides (padded vocabulary, samples seen)."""
    from .megatron import _DESTS
    flat = {k: v for section in cfg.to_dict().values() if isinstance(section, dict) for k, v in section.items()}
    for ours, theirs in _DESTS.items():
        for dest, inverted in theirs:
            if ours in flat and dest not in flat:
                flat[dest] = (not flat[ours]) if inverted else flat[ours]
    if cfg.model.hybrid_layer_pattern:  # (Megatron-LM 0.16 reads the pattern under its older name)
        flat.update(hybrid_override_pattern=cfg.model.hybrid_layer_pattern, is_hybrid_model=True)
    flat.update(padded_vocab_size=rows, consumed_train_samples=consumed, consumed_valid_samples=0,
                skipped_train_samples=0, ckpt_format="torch_dist",
                use_distributed_optimizer=True, data_parallel_random_init=False, iteration=iteration,
                transformer_impl=flat.get("transformer_impl") or "transformer_engine")
    return argparse.Namespace(**flat)


def _param_groups(cfg, lr: float, step: int, experts: bool, plain: Optional[str] = None) -> dict:
    """The optimizer's non-tensor state: Megatron's param groups (decayed, not decayed) with Adam's step (and a second,
    chained optimizer for a MoE's experts). ``plain``: Megatron's plain optimizer instead of the distributed one,
    "mixed" (bf16 / fp16 weights: its Float16Optimizer) or "fp32" (its FP32Optimizer); its step is ``common_step``."""
    op = cfg.optim

    def group(expert: bool, decay: bool) -> dict:
        return {"is_expert_parallel": expert, "default_config": True, "wd_mult": 1.0 if decay else 0.0, "lr_mult": 1.0,
                "is_decoupled_lr": False, "max_lr": op.lr, "min_lr": op.min_lr, "lr": lr,
                "betas": (op.adam_beta1, op.adam_beta2), "eps": op.adam_eps,
                "weight_decay": op.weight_decay if decay else 0.0, "amsgrad": False, "maximize": False,
                "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                "decoupled_weight_decay": True, **({} if plain else {"step": float(step)})}

    def one(groups: list) -> dict:
        if plain is None:
            return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}
        inner = {"state": {"common_step": torch.tensor(float(step))}, "param_groups": groups}
        return {"optimizer": inner} if plain == "mixed" else inner
    dense = one([group(False, True), group(False, False)])
    return {0: dense, 1: one([group(True, True)])} if experts else dense


def _scheduler(cfg, sd: dict) -> dict:
    """paratron's LR schedule state as Megatron's ``opt_param_scheduler`` (both count samples)."""
    from .megatron_state import SCHEDULE_NAMES
    tr, wd = cfg.train, cfg.optim.weight_decay  # (paratron's weight decay is constant)
    wd_steps = (tr.train_iters or 0) * tr.global_batch_size if tr.train_iters else (tr.train_samples or 0)
    return {**{theirs: sd[ours] for theirs, ours in SCHEDULE_NAMES.items()},
            "start_wd": wd, "end_wd": wd, "wd_incr_style": "constant", "wd_incr_steps": wd_steps}


def export(load, output, iteration: Optional[int] = None, force: bool = False, log=None,
           expert_parallel: Optional[int] = None, plain: bool = False) -> Path:
    """paratron checkpoint ``load`` (the latest or ``iteration``'s) -> Megatron-LM torch_dist checkpoint ``output``;
    returns its iteration directory. ``expert_parallel``: the expert-parallel size of the Megatron run that will
    load it (default the paratron run's): above 1 Megatron keeps the routed experts in a second optimizer. ``plain``:
    the optimizer state as Megatron's plain optimizer keeps it (a run without ``--use-distributed-optimizer``)."""
    from . import sharded
    from .convert import _Log, _check_output, _saved_config, _write_staged
    log = log or _Log(True)
    d = sharded.find_checkpoint(Path(load), group=sharded.SOLO, iteration=iteration)
    if d is None:
        raise ConversionError(f"no paratron checkpoint in {load}")
    common = sharded.read_common(d)
    cfg = _saved_config(common, d)
    check_exportable(cfg.model)
    shapes = sharded.tensor_shapes(d)
    if any(k.startswith("optimizer.muon_momentum.") for k in shapes):
        raise ConversionError(f"{d} holds Muon's state: Megatron's distributed optimizer resumes Adam only")
    full = sharded.load_full(d, [k for k in shapes if k.startswith(("model.", "optimizer."))])
    model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    layout = {"stacked": homogeneous(cfg.model) and not cfg.model.hybrid_layer_pattern,
              "mla": bool(cfg.model.multi_latent_attention)}
    tensors = megatron_tensors(model, cfg.model, layout)
    params = [k for k in model if f"optimizer.exp_avg.{k}" in full]
    optim = bool(params) and common.get("optimizer") is not None
    mixed = any(f"optimizer.fp32_param.{k}" in full for k in params) or any(
        model[k].dtype != torch.float32 for k in params)
    if optim:
        main = "fp32_param" if plain else "param"  # (the plain optimizer keeps fp32 mains of 16-bit weights only)
        sources = {main: {k: full.get(f"optimizer.fp32_param.{k}", model[k]) for k in params},
                   "exp_avg": {k: full[f"optimizer.exp_avg.{k}"] for k in params},
                   "exp_avg_sq": {k: full[f"optimizer.exp_avg_sq.{k}"] for k in params}}
        if plain and not mixed:
            del sources[main]
        for state, src in sources.items():
            tensors.update({f"optimizer.state.{state}.{n}": t.float()
                            for n, t in megatron_tensors(src, cfg.model, layout).items()})
    it, consumed = int(common["iteration"]), int(common.get("consumed_samples", 0))
    rows = model["embedding.word_embeddings.weight"].shape[0]
    lr = common.get("scheduler") and _lr(cfg, common["scheduler"])
    top = {"args": _args(cfg, rows, consumed, it), "checkpoint_version": 3.0, "iteration": it,
           "num_floating_point_operations_so_far": 0,
           "content_metadata": {k: v for k, v in _CONTENT.items() if not (plain and k.startswith("distrib_"))}}
    if optim:
        chained = bool(cfg.model.num_experts) and (expert_parallel or cfg.parallel.expert_model_parallel_size) > 1
        top["optimizer"] = _param_groups(cfg, lr, int(common["optimizer"]["step"]), chained,
                                         ("mixed" if mixed else "fp32") if plain else None)
        top["opt_param_scheduler"] = _scheduler(cfg, common["scheduler"])
    out = Path(output)
    old = _check_output(out, re.compile(r"^(latest_checkpointed_iteration\.txt|iter_\d{7}|release)$"), force,
                        "a Megatron-LM checkpoint", "--output")
    what = f"the {'plain' if plain else 'distributed'} optimizer state" if optim else "model weights only"
    log(f"writing Megatron-LM's torch_dist checkpoint of iteration {it} ({len(tensors)} tensors, {what}) to {out}")
    objects = extra_states({k: v for k, v in tensors.items() if not k.startswith("optimizer.")}, layout["stacked"])
    if cfg.model.hybrid_layer_pattern:  # (Megatron's MambaModel saves its output layer's too; GPTModel drops it)
        objects["output_layer._extra_state/shard_0_1"] = [None]
    _write_staged(out, old, lambda tmp: _write(tmp, it, tensors, objects, top), last=TRACKER)
    return out / f"iter_{it:07d}"


def _lr(cfg, sd: dict) -> float:
    """The LR of paratron's schedule state ``sd`` now (the param groups' ``lr``): the schedule as saved, at its
    position (LRScheduler.resume with --use-checkpoint-opt_param-scheduler)."""
    import dataclasses
    from ..optim.schedule import build_scheduler
    sched = build_scheduler(cfg, int(sd["decay_steps"]))
    sched.resume(sd, dataclasses.replace(cfg.optim, override_opt_param_scheduler=False,
                                         use_checkpoint_opt_param_scheduler=True))
    return sched.lr


def _write(tmp: Path, it: int, tensors: dict, objects: dict, top: dict) -> None:
    import torch.distributed.checkpoint as dcp
    d = tmp / f"iter_{it:07d}"
    d.mkdir(parents=True)
    state = {**{k: v.contiguous() for k, v in tensors.items()}, **objects}  # (DCP torch.saves the objects)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    torch.save(top, d / "common.pt")
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                 "common_backend": "torch", "common_backend_version": 1}))
    (tmp / TRACKER).write_text(str(it))

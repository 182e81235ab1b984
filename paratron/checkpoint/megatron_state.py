"""Resuming Megatron-LM's own torch_dist checkpoint (``--load MEGATRON_DIR`` without ``--finetune``): its training
state beside the model weights (paratron/checkpoint/megatron.py reads those).

Megatron saves its optimizer state in one of these layouts (its ``param_state_sharding_type``):

* the plain optimizer (no ``--use-distributed-optimizer``): ``optimizer.state.{exp_avg,exp_avg_sq}.{model key}`` (in
  older MoE checkpoints ``chained_{i}.`` before it: the dense and the expert optimizer), and
  with bf16 / fp16 the fp32 main weights as ``optimizer.state.fp32_param.{model key}``; Adam's step count is the
  ``common_step`` of its state in ``common.pt``;
* the distributed optimizer with ``--dist-ckpt-optim-fully-reshardable`` (``fully_reshardable``), and the older
  ``fully_sharded_model_space``: the same per-parameter global tensors, the main weights as ``optimizer.state.param.``
  (or ``fp32_param.``), the step in the param groups;
* the distributed optimizer's default, ``dp_reshardable``: flat buckets of Megatron's gradient buffers. They are
  not in the model's shape: a Megatron run reads them only at the same tensor and pipeline layout. paratron refuses
  them by name (re-save with ``--dist-ckpt-optim-fully-reshardable`` in Megatron, or fine-tune from the weights).

The model-space tensors have the model's names and stacked-layer shapes, so megatron.dist_pieces reads them into any
layout of this run, exactly as the weights. The iteration comes from ``common.pt``, the consumed samples from the
saved ``args``, the LR schedule's position from Megatron's ``opt_param_scheduler`` state (counted in samples, as
paratron's), the loss scale from its ``grad_scaler``. Megatron's random generator states are not paratron's: they
restart from ``--seed``.
"""
from __future__ import annotations

import re
from typing import Any, Iterator, Optional

from .megatron import _args
from .pieces import CheckpointError

MODEL_SPACE = ("fully_reshardable", "fully_sharded_model_space")
READ = MODEL_SPACE + ("dp_reshardable",)  # (megatron_buckets.py reads dp_reshardable)
_STATES = ("exp_avg", "exp_avg_sq")
_MASTERS = ("optimizer.state.fp32_param.", "optimizer.state.param.")
# Megatron's OptimizerParamScheduler.state_dict() key -> paratron's LRScheduler key
SCHEDULE_NAMES = {"max_lr": "max_lr", "min_lr": "min_lr", "lr_warmup_steps": "warmup_steps",
             "lr_decay_steps": "decay_steps", "lr_decay_style": "decay_style", "num_steps": "num_steps"}


def _walk(obj: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) of the nested dicts and lists ``obj``."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k), v
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


def sharding_type(common: dict) -> Optional[str]:
    """Megatron's ``param_state_sharding_type`` of the distributed optimizer's state; None for the plain optimizer
    (and for a checkpoint without optimizer state)."""
    found = {v for k, v in _walk(common.get("optimizer")) if k == "param_state_sharding_type"}
    return next(iter(found)) if found else None


def _chains(saved: dict) -> tuple:
    """The prefixes Megatron's per-parameter optimizer state has: none, or (older MoE checkpoints, a chained dense
    and expert optimizer) ``chained_{i}.``."""
    found = sorted({k.split(".", 1)[0] + "." for k in saved if re.match(r"^chained_\d+\.optimizer\.state\.", k)})
    return tuple(found) or ("",)


def master_prefix(saved: dict) -> Optional[tuple]:
    """Megatron's prefixes of the fp32 main weights in the checkpoint's tensors ``saved``; None when it has none (an
    fp32 model under the plain optimizer: the weights are the main weights)."""
    for m in _MASTERS:
        options = tuple(c + m for c in _chains(saved))
        if any(k.startswith(options) for k in saved):
            return options
    return None


def prefixes(saved: dict) -> dict:
    """{paratron's checkpoint prefix: Megatron's candidates} for the model and the optimizer state
    (megatron.dist_pieces)."""
    out = {"model.": ""}
    out.update({f"optimizer.{s}.": tuple(f"{c}optimizer.state.{s}." for c in _chains(saved)) for s in _STATES})
    masters = master_prefix(saved)
    if masters is not None:
        out["optimizer.fp32_param."] = masters
    return out


def has_optimizer_state(saved: dict) -> bool:
    """Whether Megatron saved Adam's moments: per parameter, or in the distributed optimizer's buckets."""
    return any(f".optimizer.state.{_STATES[0]}." in f".{k}" or
               (".optimizer.distributed." in f".{k}" and k.endswith(f".{_STATES[0]}")) for k in saved)


def check_resumable(d, common: dict, saved: dict, optimizer: str) -> None:
    """Stop with one line where this run cannot take the optimizer state of Megatron checkpoint ``d``."""
    args = _args(common.get("args"))
    kind = sharding_type(common)
    if kind is not None and kind not in READ:
        raise CheckpointError(f"{d}: Megatron's distributed optimizer saved its state as {kind!r}, which paratron "
                              f"does not read ({', '.join(READ)} it does): resume with --no-load-optim or --finetune, "
                              "or re-save it from Megatron with --dist-ckpt-optim-fully-reshardable")
    check_optimizer(d, has_optimizer_state(saved), args, optimizer)


def check_optimizer(d, present: bool, args: dict, optimizer: str) -> None:
    """Stop with one line where Megatron checkpoint ``d`` holds no optimizer state (``present``) or another
    optimizer's than this run's (both formats)."""
    if not present:
        raise CheckpointError(f"{d} holds no optimizer state (saved with --no-save-optim?): pass --no-load-optim "
                              "or --finetune, as Megatron asks")
    theirs = str(args.get("optimizer", "adam"))
    if theirs != optimizer:
        raise CheckpointError(f"{d} holds the state of Megatron's {theirs!r} optimizer, this run uses {optimizer!r}: "
                              f"pass --optimizer {theirs}, or --no-load-optim")


def adam_step(common: dict) -> int:
    """Adam's step count: the ``common_step`` (plain optimizer) or the param groups' ``step`` (distributed)."""
    steps = {int(v.item() if hasattr(v, "item") else v) for k, v in _walk(common.get("optimizer"))
             if k in ("common_step", "step") and v is not None}
    if len(steps) != 1:
        raise CheckpointError(f"Megatron's optimizer state names {len(steps)} different step counts {sorted(steps)}; "
                              "paratron takes one shared step (pass --no-load-optim to start the moments afresh)")
    return steps.pop()


def scheduler_state(common: dict) -> Optional[dict]:
    """Megatron's ``opt_param_scheduler`` state in paratron's LRScheduler keys (LRScheduler.resume); None when
    the checkpoint has none."""
    sd = common.get("opt_param_scheduler")
    if not isinstance(sd, dict) or "num_steps" not in sd:
        return None
    return {ours: sd[theirs] for theirs, ours in SCHEDULE_NAMES.items() if theirs in sd}


def scaler_state(common: dict) -> Optional[dict]:
    """The fp16 loss scaler's state (``grad_scaler``: scale, growth and hysteresis trackers), None without one."""
    found = [v for k, v in _walk(common.get("optimizer")) if k == "grad_scaler" and isinstance(v, dict)]
    if not found:
        return None
    sd = dict(found[0])
    if hasattr(sd.get("scale"), "item"):
        sd["scale"] = float(sd["scale"].item())
    return sd


def with_objects(common: dict, d) -> dict:
    """``common`` with Megatron's optimizer state saved as byte objects (the distributed optimizer's param groups,
    step and loss scaler in its dp_reshardable layout) added under ``optimizer``."""
    from .megatron_buckets import objects
    found = objects(d)
    if not found:
        return common
    return {**common, "optimizer": {"common": common.get("optimizer"), "objects": found}}


def position(common: dict) -> tuple[int, int]:
    """(iteration, consumed training samples) of the checkpoint."""
    args = _args(common.get("args"))
    return int(common.get("iteration", 0) or 0), int(args.get("consumed_train_samples", 0) or 0)

"""Step hooks: the modules that keep state from one training step to the next (MoE routers, MTP blocks,
the delayed FP8 recipe's scalers) are found once, when the Trainer is built, and called by
``Trainer.train_step`` at three fixed points through one protocol:

- ``before_step``: after the gradient buffers are zeroed, before the forward-backward passes
  (the MoE aux losses' and the MTP loss's backward scale; the FP8 weights cast for the step's micro-batches);
- ``after_forward_backward``: after the last backward pass, before the gradients are finalized
  (the delayed FP8 scalers take their scales from their histories from now on; the cached FP8 weights dropped);
- ``after_step``: after the optimizer step, before the learning-rate schedule advances (the MoE
  routers' aux-loss-free expert bias update).

A provider is a function of the model chunks that returns the hooks of one kind of module (an empty
dict when the model has none); each hook takes the step's :class:`StepContext`. Hooks of a phase run
in the order of ``PROVIDERS``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..model import moe, mtp
from .. import fp8
from ..fp8 import weights as fp8_weights
from ..parallel.dims import ParallelDims

PHASES = ("before_step", "after_forward_backward", "after_step")


@dataclass(frozen=True)
class StepContext:
    """What a step hook may read. ``loss_scale`` is the step's (the optimizer's before its step updates
    it), ``num_microbatches`` this rank's micro-batch count in the step, ``per_token_loss``
    --calculate-per-token-loss (gradients are sums, divided by the step's token count afterwards)."""
    loss_scale: Any
    num_microbatches: int
    per_token_loss: bool
    dims: ParallelDims


Hook = Callable[[StepContext], None]


# ---- the providers ---------------------------------------------------------------------------------
def moe_hooks(models) -> dict[str, Hook]:
    """The MoE routers: the aux losses' backward scale before the step, the expert bias update after."""
    routers = moe.routers(models)
    if not routers:
        return {}

    def before(ctx: StepContext) -> None:
        moe.before_step(routers, ctx.loss_scale, ctx.num_microbatches, ctx.per_token_loss, ctx.dims.cp)

    def after(ctx: StepContext) -> None:  # under CP, the routers' partition is the data-parallel group
        moe.after_step(routers, ctx.dims.dp_group if ctx.dims.dp > 1 else None)
    return {"before_step": before, "after_step": after}


def mtp_hooks(models) -> dict[str, Hook]:
    """The multi-token prediction blocks (--mtp-num-layers): the MTP loss's backward scale."""
    blocks = mtp.blocks(models)
    if not blocks:
        return {}

    def before(ctx: StepContext) -> None:
        mtp.before_step(blocks, ctx.loss_scale, ctx.num_microbatches, ctx.per_token_loss)
    return {"before_step": before}


def fp8_hooks(models) -> dict[str, Hook]:
    """The delayed FP8 recipe's scalers: after a step's backward passes every amax history holds an amax,
    so the scales come from the histories alone from then on."""
    states = fp8.delayed_states(models)
    if not states:
        return {}
    return {"after_forward_backward": lambda ctx: fp8.prime(states)}


def fp8_weight_hooks(models) -> dict[str, Hook]:
    """The FP8 layers' weight cache (paratron/fp8/weights.py): a step of several micro-batches casts each FP8
    weight once, before its first forward, and drops the copies after its last backward."""
    layers = fp8_weights.cached_layers(models)
    if not layers:
        return {}

    def before(ctx: StepContext) -> None:
        if ctx.num_microbatches > 1:
            fp8_weights.fill(layers)

    def after(ctx: StepContext) -> None:
        fp8_weights.drop(layers)
    return {"before_step": before, "after_forward_backward": after}


PROVIDERS = (moe_hooks, mtp_hooks, fp8_hooks, fp8_weight_hooks)  # (this order is the order the hooks of a phase run in)


class StepHooks:
    """Every step hook of the model chunks, registered once (``StepHooks(models)``)."""

    def __init__(self, models, providers=PROVIDERS):
        self._hooks: dict[str, list[Hook]] = {phase: [] for phase in PHASES}
        for provide in providers:
            for phase, hook in provide(models).items():
                self._hooks[phase].append(hook)  # (KeyError: a provider's unknown phase)

    def _run(self, phase: str, ctx: StepContext) -> None:
        for hook in self._hooks[phase]:
            hook(ctx)

    def before_step(self, ctx: StepContext) -> None:
        self._run("before_step", ctx)

    def after_forward_backward(self, ctx: StepContext) -> None:
        self._run("after_forward_backward", ctx)

    def after_step(self, ctx: StepContext) -> None:
        self._run("after_step", ctx)

    def __len__(self) -> int:
        return sum(len(h) for h in self._hooks.values())

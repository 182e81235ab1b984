"""The step hooks protocol (paratron/train/hooks.py): providers register once, each phase runs its hooks in
the providers' order, and a model without stateful modules registers none."""
import torch

from paratron.parallel.dims import ParallelDims
from paratron.train.hooks import StepContext, StepHooks


def test_hooks_run_by_phase_in_provider_order():
    calls = []

    def first(models):
        return {"before_step": lambda ctx: calls.append(("first", "before", ctx.num_microbatches)),
                "after_step": lambda ctx: calls.append(("first", "after", ctx.num_microbatches))}

    def second(models):
        return {"before_step": lambda ctx: calls.append(("second", "before", ctx.num_microbatches)),
                "after_forward_backward": lambda ctx: calls.append(("second", "fb", ctx.num_microbatches))}

    hooks = StepHooks([], providers=(first, second))
    assert len(hooks) == 4
    ctx = StepContext(loss_scale=1.0, num_microbatches=3, per_token_loss=False, dims=ParallelDims())
    hooks.before_step(ctx)
    hooks.after_forward_backward(ctx)
    hooks.after_step(ctx)
    assert calls == [("first", "before", 3), ("second", "before", 3), ("second", "fb", 3), ("first", "after", 3)]


def test_a_dense_model_registers_no_hook():
    assert len(StepHooks([torch.nn.Linear(2, 2)])) == 0

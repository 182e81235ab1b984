"""--overlap-moe-expert-parallel-comm: a micro-batch's forward and an earlier micro-batch's backward take turns, so
that each expert all-to-all travels while the other micro-batch computes (Megatron's combined 1F1B overlap).
Without pipelining this module's schedule runs them; with pipeline parallelism (interleaved) 1F1B pairs them in its
steady-state slots (pipeline.py: ``schedule_table(turns=True)``), each pair run by :func:`taking_turns`.

The plain schedule runs F0 B0 F1 B1 ... : every dispatch and combine all-to-all of the MoE layers (and their
reverse in backward) leaves the GPU's compute idle while the rows travel. This one runs F0, then for each later
micro-batch i its forward beside B(i-1), then B(last): the forward in the calling thread, the backward in a helper
thread, never both at once. Whoever runs holds the turn; an all-to-all (``parallel/experts.py: _exchange``)
starts asynchronously, hands the turn over (``Turns.handoff``), and waits for its rows only when the turn comes
back, after the other micro-batch has queued its work up to its own next all-to-all. On a GPU both threads queue
kernels on the same stream, so the only concurrency is that of the all-to-alls (on the communicator's stream) with
the other micro-batch's kernels: no allocator or stream hazards, no races on Python state. The order of every
collective is the same on every rank (the hand-offs happen at the same points of the same model), and the
arithmetic is the plain schedule's: forwards draw random numbers in the same order, gradients accumulate
micro-batch by micro-batch as before, so the loss and the gradients equal the plain schedule's (tested on gloo,
tests/parallel/test_moe_turns.py).

The layers that take part are those with an ``exchange_turn`` attribute (the MoE layers: ``model/moe.py``), set
to the step's hand-off while two micro-batches are in flight and back to None after.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

import torch

from .layout import BatchLayout, microbatch_loss


class Turns:
    """Two parties that take turns: ``run(first, second)`` runs both, ``first`` starting; a party's
    ``handoff()`` passes the turn to the other one (if it has not finished) and returns when the turn is back.
    A party that finishes passes the turn for good; an exception in either is raised by ``run`` after both end."""

    def __init__(self):
        self._cond = threading.Condition()
        self._turn = 0
        self._running = [True, True]
        self._errors: list = []

    def handoff(self) -> None:
        with self._cond:
            me = self._turn
            if not self._running[1 - me]:
                return
            self._turn = 1 - me
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == me)

    def _party(self, index: int, fn: Callable, device) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == index)
        try:
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                fn()
        except BaseException as e:  # raised again by run()
            self._errors.append(e)
        finally:
            with self._cond:
                self._running[index] = False
                self._turn = 1 - index
                self._cond.notify_all()

    def run(self, first: Callable, second: Callable) -> None:
        """``first`` in this thread, ``second`` in a helper thread (same CUDA device and stream)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        stream = torch.cuda.current_stream() if device is not None else None

        def helper():
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                second()

        thread = threading.Thread(target=self._party, args=(1, helper, device), name="paratron-backward")
        thread.start()
        self._party(0, first, None)
        thread.join()
        if self._errors:
            raise self._errors[0]


def microbatch_forward(forward_step_func: Callable, data_iterator, model, layout: Optional[BatchLayout],
                       num_microbatches: int) -> tuple:
    """(the loss one micro-batch backpropagates, its report): the forward step and its loss function, the loss
    normalised as ``layout`` says (the default normalisation without one)."""
    output, loss_func = forward_step_func(data_iterator, model)
    loss_sum, num_tokens, report = loss_func(output)
    loss = (layout.microbatch_loss(loss_sum, num_tokens, num_microbatches) if layout is not None
            else microbatch_loss(loss_sum, num_tokens, num_microbatches))
    return loss, report


def turn_takers(models: list) -> list:
    """The layers of ``models`` that take turns at their all-to-alls (those with ``exchange_turn``: the MoE layers),
    found once per schedule call."""
    return [m for model in models for m in model.modules() if hasattr(m, "exchange_turn")]


def settle_weight_grads(takers: list) -> None:
    """Any weight gradient a layer still owes (--delay-wgrad-compute: ``settle_wgrad``), before the step uses them."""
    for m in takers:
        m.settle_wgrad()


@contextlib.contextmanager
def taking_turns(takers: list):
    """A :class:`Turns` whose hand-off the layers ``takers`` (:func:`turn_takers`) call at their all-to-alls while it
    is open."""
    turns = Turns()
    for m in takers:
        m.exchange_turn = turns.handoff
    try:
        yield turns
    finally:
        for m in takers:
            m.exchange_turn = None


def forward_backward_combined(*, forward_step_func: Callable, data_iterator: Iterator, model,
                              num_microbatches: int, layout: Optional[BatchLayout] = None, forward_only: bool = False,
                              grad_scale: float = 1.0, plain: Callable, **rest) -> list[dict]:
    """Gradient accumulation over micro-batches on one pipeline stage, each forward beside the previous
    micro-batch's backward (see the module docstring); ``plain``: the plain schedule, for evaluation and a single
    micro-batch."""
    if forward_only or num_microbatches == 1:
        return plain(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                     num_microbatches=num_microbatches, layout=layout, forward_only=forward_only,
                     grad_scale=grad_scale, **rest)
    if isinstance(model, (list, tuple)):
        (model,) = model
    reports: list = []

    def forward() -> torch.Tensor:
        loss, report = microbatch_forward(forward_step_func, data_iterator, model, layout, num_microbatches)
        reports.append(report)
        return loss * grad_scale

    takers = turn_takers([model])
    no_sync = getattr(model, "no_sync", None)  # DataParallel: no gradient reduction before the last micro-batch
    with no_sync() if no_sync is not None else contextlib.nullcontext():
        pending = forward()
        for _ in range(1, num_microbatches):
            done: list = []
            with taking_turns(takers) as turns:
                turns.run(lambda: done.append(forward()), pending.backward)
            pending = done[0]
    pending.backward()
    settle_weight_grads(takers)
    return reports

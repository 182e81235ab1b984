"""The optimizer step of a training step beside the next step's forward (CUDA, fused AdamW).

The on-device step (``MixedPrecisionAdam._step_on_device``) is memory-bound: on llama-1b it reads and
writes ~30 bytes per parameter, ~15 ms per step on an H100, while the GPU's compute units idle. The
next step's forward is compute-bound and needs the updated weights one model piece at a time: the
embedding first, then each decoder layer, the final norm and the output layer last. So the trainer
runs the step's AdamW kernels on a side stream, piece by piece in that order, and each piece's forward
pre-hook makes the compute stream wait for its own piece only (an event per piece): the update of
layer 5 runs while layer 0 computes.

Nothing else changes: the same kernels in the same order over the same tensors (bit-identical
results), the gradient norm and the clip coefficient still computed on the compute stream first. The
gradients of the weights whose backward adds into ``main_grad`` (gradient-accumulation fusion) are
zeroed on the side stream right after their piece is stepped, so the next step's
``zero_grad_buffer`` does not touch them while the side stream may still read them.

Readers of the weights other than a forward (checkpoint save, the weight-hash check, the parameter
norm's log) call :meth:`StepOverlap.wait` first; a finished forward waits for the whole step (its
post-hook), so a backward never runs against weights being written. PARATRON_OPTIMIZER_OVERLAP=0 turns
it off (the step then runs on the compute stream, as before).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch import nn


def enabled(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and os.environ.get("PARATRON_OPTIMIZER_OVERLAP", "1") != "0"


def forward_pieces(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module whose forward needs them first, parameters) in the order a GPT model's forward uses them:
    the model itself (embedding and whatever is not below), each decoder layer, the final norm with the
    output layer (the fused loss reads the output weight without calling the layer). A tied weight
    belongs to its first piece."""
    decoder = getattr(model, "decoder", None)
    layers = list(getattr(decoder, "layers", []))
    pieces = [(layer, list(layer.parameters())) for layer in layers]
    final = getattr(decoder, "final_layernorm", None)
    if final is not None:
        out = getattr(model, "output_layer", None)
        pieces.append((final, list(final.parameters()) + (list(out.parameters()) if out is not None else [])))
    claimed = {p for _, ps in pieces for p in ps}
    head = [p for p in model.parameters() if p not in claimed]
    seen: set = set()
    ordered = []
    for module, ps in [(model, head)] + pieces:
        ordered.append((module, [p for p in ps if not (p in seen or seen.add(p))]))
    return ordered


class StepOverlap:
    """The side stream, the per-piece events and the forward hooks of one trainer's model chunks.
    ``wrappers``: the DataParallel-wrapped chunks (``.module`` the GPT model, ``.params`` its
    parameters); ``masters``: {parameter: its fp32 master}."""

    def __init__(self, wrappers: list, masters: dict):
        self.stream = torch.cuda.Stream(device=next(iter(masters.values())).device)
        self.wrappers = wrappers
        pieces = [piece for w in wrappers for piece in forward_pieces(w.module)]
        self.batches = [[masters[p] for p in ps if p in masters] for _, ps in pieces]
        placed = {id(m) for b in self.batches for m in b}
        self.batches[0] += [m for m in masters.values() if id(m) not in placed]  # (none for a GPT model)
        self._fused = [[p.main_grad for p in ps if p in masters and getattr(p, "fuse_wgrad", False)]
                       for _, ps in pieces]
        self._fused[0] += [p.main_grad for p, m in masters.items() if id(m) not in placed
                           and getattr(p, "fuse_wgrad", False)]
        self.events = [torch.cuda.Event() for _ in pieces]
        self._waiting: list[bool] = [False] * len(pieces)
        self._hooks = []
        for i, (module, _) in enumerate(pieces):
            wait = torch._dynamo.disable(lambda _m, _a, i=i: self.wait(i))
            self._hooks.append(module.register_forward_pre_hook(wait))
        for w in wrappers:  # after a forward every piece is updated: its backward never races the step
            self._hooks.append(w.module.register_forward_hook(torch._dynamo.disable(lambda *_: self.wait())))

    def run(self, step: Callable[[list, Callable[[int], None]], None], used: list[Optional[torch.Tensor]]) -> None:
        """``step(batches, after_batch)`` launches the update of each batch of masters in order, calling
        ``after_batch(i)`` after batch i; it runs on the side stream once the compute stream's work so far
        (the gradients, their norm) is done. ``used``: tensors the compute stream made for the step (the
        clip coefficient, the inf flag), kept from reuse until the side stream is done with them."""
        self.wait()  # (a step whose predecessor's update was never waited for)
        self.stream.wait_stream(torch.cuda.current_stream())
        for t in used:
            if t is not None:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            step(self.batches, self._after_batch)
        for w in self.wrappers:
            w.fused_grads_zeroed = True
        self._waiting = [True] * len(self.events)

    def _after_batch(self, i: int) -> None:
        if self._fused[i]:
            torch._foreach_zero_(self._fused[i])
        self.events[i].record(self.stream)

    def wait(self, i: Optional[int] = None) -> None:
        """Make the current stream wait for piece ``i``'s update (None: the whole step)."""
        if i is None:
            if any(self._waiting):
                torch.cuda.current_stream().wait_event(self.events[-1])
                self._waiting = [False] * len(self.events)
        elif self._waiting[i]:
            torch.cuda.current_stream().wait_event(self.events[i])
            for j in range(i + 1):
                self._waiting[j] = False

    def close(self) -> None:
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks = []

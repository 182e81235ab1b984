"""``--cuda-graph-impl local --cuda-graph-scope full_iteration``: a training step's forward and backward passes
(every micro-batch, with the step hooks around them) captured once as one CUDA graph and replayed at each step.

The host then issues a step's thousands of kernels with one call, so a step whose kernels are shorter than the
Python that launches them (small micro-batches, MoE layers, many small layers) no longer waits for the host. Outside
the graph stay the data loader (each step's micro-batches are copied into the graph's input buffers before the
replay), the gradient reduction over data-parallel ranks, the optimizer, logging and evaluation.

The first ``--cuda-graph-warmup-steps`` steps run eagerly: compilation, autotuning, cuBLASLt's timings and the
delayed FP8 scalers' first amaxes happen there. The next step is captured and replayed. A captured step holds what
its Python decided while it was captured (the micro-batch count, the loss scale, the shapes of the micro-batches),
so when one of those changes (a batch-size ramp, a new fp16 loss scale) the graph is dropped and, after as many eager
steps again, captured anew.

What a captured step may not do: read a device value on the host (a synchronisation; ``benchmarks/host_sync.py``
finds them), draw from a random generator other than the device's default one, or move data between host and device
mid-step. config/check_graphs.py refuses the flags that would; anything else stops the capture with its reason.
"""
from __future__ import annotations

import gc
import time
from functools import partial
from typing import Callable, Iterator, Optional

import torch

from ..errors import ConfigError
from ..parallel.layout import ID_KEYS, BatchLayout, CheckedBatch, check_batch_ids

CAPTURE_FAILED = ("--cuda-graph-impl local: the training step could not be captured as a CUDA graph ({}): a step "
                  "that reads a device value on the host or changes what it does from one step to the next cannot be "
                  "replayed (a layer still compiling needs more --cuda-graph-warmup-steps); run without "
                  "--cuda-graph-impl, or find the host read with benchmarks/host_sync.py")


def _signature(batch: dict) -> tuple:
    """What a micro-batch's shapes make the captured step depend on: each key with its tensor's shape and dtype."""
    return tuple((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v))
                 for k, v in sorted(batch.items()))


def _number(scale) -> object:
    return float(scale) if isinstance(scale, (int, float)) else id(scale)


def _cloned(value):
    """``value`` (the reports of the micro-batches: lists and dicts of tensors) with every tensor copied out of the
    graph's memory, which the next replay overwrites."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


class StepGraph:
    """Runs a step's passes eagerly, or captures and replays them (see the module docstring). ``check``: the
    host-side check of a micro-batch (its token ids), which the captured step no longer runs; ``state``: (get, set)
    of what the passes leave on the host (the data-parallel wrappers' record of the parameters without a gradient),
    read after the capture and set again after each replay, which runs no Python."""

    def __init__(self, warmup_steps: int, device: torch.device, check: Callable[[dict], None] = lambda b: None,
                 log: Callable[[str], None] = print, state: Optional[tuple] = None):
        self.warmup_steps, self.device, self.check, self.log = warmup_steps, device, check, log
        self.state = state
        self.kept = None  # the host state the captured passes left
        self.key: Optional[tuple] = None
        self.eager_left = warmup_steps
        self.graph = None
        self.inputs: list[dict] = []  # the captured step's micro-batches on the device, refilled before each replay
        self.outputs = None  # what the captured passes returned (tensors in the graph's memory)
        self.captures = 0

    def run(self, passes: Callable[[Iterator], list], data_iterator: Iterator, num_microbatches: int,
            loss_scale) -> list:
        """``passes(iterator over the step's micro-batches)`` -> the micro-batches' reports, run eagerly or replayed."""
        batches = [next(data_iterator) for _ in range(num_microbatches)]
        key = (num_microbatches, _number(loss_scale), tuple(_signature(b) for b in batches))
        if key != self.key:
            self._drop()
            self.key, self.eager_left = key, self.warmup_steps
        if self.eager_left > 0:
            self.eager_left -= 1
            return passes(iter(batches))
        for b in batches:
            self.check(b)
        if self.graph is None:
            self._capture(passes, batches)
        else:
            for static, batch in zip(self.inputs, batches):
                for k, v in batch.items():
                    if isinstance(v, torch.Tensor):
                        static[k].copy_(v, non_blocking=True)
        self.graph.replay()
        if self.state is not None:
            self.state[1](self.kept)
        return _cloned(self.outputs)

    def _capture(self, passes: Callable[[Iterator], list], batches: list[dict]) -> None:
        start = time.perf_counter()
        self.inputs = [CheckedBatch({k: v.to(self.device, copy=True) if isinstance(v, torch.Tensor) else v
                                     for k, v in b.items()}) for b in batches]  # (no device-side id check inside)
        try:
            self.graph, self.outputs = self._record(passes)
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(CAPTURE_FAILED.format(first)) from e
        self.captures += 1
        if self.state is not None:
            self.kept = self.state[0]()
        held = (f", {torch.cuda.memory_reserved(self.device) / 2**30:.1f} GiB reserved" if self.device.type == "cuda"
                else "")
        self.log(f"CUDA graph: the step's forward and backward passes captured in {time.perf_counter() - start:.1f} s "
                 f"({len(batches)} micro-batches{held}); replayed from now on")

    def _record(self, passes: Callable[[Iterator], list]) -> tuple:
        """(the CUDA graph of ``passes`` over the input buffers, what they return): captured, not run."""
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()  # the eager steps' cached blocks back to the device: the graph has a pool of its own
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # (the pin-memory thread may allocate)
            outputs = passes(iter(self.inputs))
        return graph, outputs

    def _drop(self) -> None:
        if self.graph is not None:
            self.log("CUDA graph: the step changed (micro-batches, loss scale or shapes): dropped; captured again "
                     f"after {self.warmup_steps} eager steps")
        self.graph, self.inputs, self.outputs = None, [], None

    @classmethod
    def of_run(cls, warmup_steps: int, device: torch.device, models: list, layout: BatchLayout, model: str,
               log: Callable[[str], None]) -> "StepGraph":
        """The step graph of a training run: its data-parallel ``models``' host state, the token-id check of its
        ``model`` family's micro-batches (gpt, bert, t5) against ``layout``'s vocabulary."""
        check = partial(check_batch_ids, vocab_size=layout.vocab_size, keys=ID_KEYS.get(model, ID_KEYS["gpt"]))
        state = (lambda: [m.step_state() for m in models],
                 lambda kept: [m.set_step_state(s) for m, s in zip(models, kept)])
        return cls(warmup_steps, device, check, log, state)


def step_graph(cfg, device: torch.device, models: list, layout: BatchLayout, log: Callable[[str], None]):
    """The run's :class:`StepGraph` (``--cuda-graph-impl local``) over the data-parallel ``models``, or None."""
    if cfg.train.cuda_graph_impl != "local":
        return None
    return StepGraph.of_run(cfg.train.cuda_graph_warmup_steps, device, models, layout, cfg.model.model, log)

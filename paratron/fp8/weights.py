"""FP8 copies of the weights, cast once per training step (Transformer Engine's weight caching, which Megatron
Core switches off with ``disable_parameter_transpose_cache``). In paratron the cache is asked for with
``--kernel-fp8-weight-cache on`` (the switch's ``auto`` leaves it off: a GPU measurement found the step slower with
it, docs/performance.md); ``--disable-parameter-transpose-cache`` keeps it off.

A weight does not change between the optimizer steps, yet an FP8 layer casts it at every forward: with N
micro-batches per step (gradient accumulation, pipeline schedules) the same cast runs N times, and each backward
makes the transposed copy its input-gradient GEMM reads once more. When a step has several micro-batches, the
step hook (``before_step``) casts every dense FP8 weight once, in both layouts, into its layer's
``FP8State.weight_cache``; the layers read the copies from there, and the hook drops them after the last
backward (``after_forward_backward``), before the optimizer changes the weights. A step of one micro-batch, an
evaluation and inference cast in the layer as before.

What the cache holds per recipe: tensorwise / delayed, the e4m3 weight, its scale and the column-major copy the
input gradient reads; blockwise, the 128 x 128 blocks and their scales. The numbers are those of the cast in the
layer: the same weight, the same scaler. One difference with the delayed recipe: the weight's amax is recorded once
per step instead of once per micro-batch (its history then covers more steps; Transformer Engine records it the
same way).

The routed experts' weights are still cast at every micro-batch: with the copies given to the fused FP8 experts
function, torch 2.11's compiler stopped on an assertion of its own on an H200 (the CPU tests passed under torch
2.11 and 2.13), so they wait for a GPU run that shows them working
(``benchmarks/results/gpu_tests_fp8_weight_cache_h200_20261206.md``).

The weights must be in place when the step starts, so the cache is off where they are not: ZeRO-3 gathers them
before each layer, ``--overlap-param-gather`` overlaps their all-gather with the first forward. It costs the
transposed copies' memory (one byte a weight element) from the step's first forward to its last backward."""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.fp8_block import quantize_blocks
from .recipe import E4M3, FP8State, column_major


def _fp8_modules(models) -> list:
    """Every module of ``models`` with an FP8 state and a weight (the routed experts' weight is 3-D)."""
    return [m for model in models for m in model.modules()
            if getattr(m, "fp8", None) is not None and isinstance(getattr(m, "weight", None), torch.Tensor)]


def _layers(models) -> list:
    """(module, FP8State) of every dense FP8 layer of ``models`` (a 2-D weight: not the routed experts)."""
    return [(m, m.fp8) for m in _fp8_modules(models) if m.weight.dim() == 2]


def why_not(models) -> Optional[str]:
    """Why the weights cannot be cast at the start of a step (None: they can)."""
    for model in models:
        if getattr(getattr(model, "units", None), "params_sharded", False):
            return "ZeRO-3 gathers the weights layer by layer"
        if getattr(model, "overlap_param_gather", False):
            return "--overlap-param-gather gathers them during the first forward"
    return None


def cached_layers(models) -> list:
    """The (module, FP8State) pairs whose weights the step hook caches (empty: none, or the cache is off)."""
    layers = [(m, s) for m, s in _layers(models) if s.recipe.weight_cache]
    return layers if layers and why_not(models) is None else []


def describe(models) -> str:
    """How the FP8 weights are cast, for the start-up line ("" without FP8 layers)."""
    layers = _layers(models)
    if not layers:
        return ""
    if not any(s.recipe.weight_cache for _, s in layers):
        return "; weights cast at every micro-batch (once per step: --kernel-fp8-weight-cache on)"
    why = why_not(models)
    if why is not None:
        return f"; weights cast at every micro-batch ({why})"
    experts = any(m.weight.dim() == 3 for m in _fp8_modules(models))
    return "; weights cast once per step of several micro-batches" + (
        " (the routed experts' at every micro-batch)" if experts else "")


def cast(state: FP8State, weight: torch.Tensor) -> tuple:
    """(wq, sw, wt): the 2-D ``weight`` cast as its layer's forward casts it, with the column-major copy its
    input-gradient GEMM reads (None under blockwise, whose GEMM reads the blocks themselves)."""
    w = weight.detach()
    with torch.no_grad():
        if state.recipe.recipe == "blockwise":
            state.mark("weight")
            return (*quantize_blocks(w, E4M3, state.recipe.margin), None)
        wq, sw = state.quantize("weight", w)
        return wq, sw, column_major(wq)


def fill(layers: list) -> None:
    """Cast the weight of every (module, state) of ``layers`` into its state's cache."""
    for m, s in layers:
        s.weight_cache = cast(s, m.weight)


def drop(layers: list) -> None:
    for _, s in layers:
        s.weight_cache = None

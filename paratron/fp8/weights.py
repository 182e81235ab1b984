"""FP8 copies of the weights, cast once per training step (Transformer Engine's weight caching, which Megatron
Core switches off with ``disable_parameter_transpose_cache``; paratron's ``--disable-parameter-transpose-cache``).

A weight does not change between the optimizer steps, yet an FP8 layer casts it at every forward: with N
micro-batches per step (gradient accumulation, pipeline schedules) the same cast runs N times, and each backward
makes the transposed copy its input-gradient GEMM reads once more. When a step has several micro-batches, the
step hook (``before_step``) casts every FP8 weight once, in both layouts, into its layer's
``FP8State.weight_cache``; the layers read the copies from there, and the hook drops them after the last
backward (``after_forward_backward``), before the optimizer changes the weights. A step of one micro-batch, an
evaluation and inference cast in the layer as before.

What the cache holds per recipe: tensorwise / delayed, the e4m3 weight and its scale plus the copy the input
gradient reads (column-major for a dense layer, each expert's weight transposed for the routed experts); blockwise,
the 128 x 128 blocks and their scales (and the routed experts' transposed blocks). The numbers are those of the
cast in the layer: the same weight, the same scaler. One difference with the delayed recipe: the weight's amax is
recorded once per step instead of once per micro-batch (its history then covers more steps; Transformer Engine
records it the same way).

The weights must be in place when the step starts, so the cache is off where they are not: ZeRO-3 gathers them
before each layer, ``--overlap-param-gather`` overlaps their all-gather with the first forward. It costs the
transposed copies' memory (one byte a weight element) from the step's first forward to its last backward."""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.fp8_block import quantize_blocks
from .experts import _transposed_blocks, _weight_blocks, backward_path, grouped_path, scale_kind
from .recipe import E4M3, FP8State, column_major


def _layers(models) -> list:
    """(module, FP8State) of every FP8 layer of ``models`` that has a weight."""
    return [(m, m.fp8) for model in models for m in model.modules()
            if getattr(m, "fp8", None) is not None and isinstance(getattr(m, "weight", None), torch.Tensor)]


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
        return "; weights cast at every micro-batch (--disable-parameter-transpose-cache)"
    why = why_not(models)
    if why is not None:
        return f"; weights cast at every micro-batch ({why})"
    return "; weights cast once per step of several micro-batches"


def cast(state: FP8State, weight: torch.Tensor) -> tuple:
    """(wq, sw, wt, swt): ``weight`` cast as its layer's forward casts it, with the copy its input-gradient GEMM
    reads (None where that GEMM reads ``wq`` itself or runs on the bf16 weight)."""
    w = weight.detach()
    margin = state.recipe.margin
    with torch.no_grad():
        if w.dim() == 3:  # the routed experts [E, N, K]
            kind = scale_kind(state)
            state.mark("weight")
            if kind == "block":
                wq, sw = _weight_blocks(w, margin)
                return (wq, sw, *_transposed_blocks(wq, sw))
            wq, sw = state.weight.quantize(w)
            if backward_path(state, grouped_path(state, kind)) == "bf16":
                return wq, sw, None, None
            return wq, sw, wq.transpose(1, 2).contiguous(), sw
        if state.recipe.recipe == "blockwise":
            state.mark("weight")
            return (*quantize_blocks(w, E4M3, margin), None, None)
        wq, sw = state.quantize("weight", w)
        return wq, sw, column_major(wq), sw


def fill(layers: list) -> None:
    """Cast the weight of every (module, state) of ``layers`` into its state's cache."""
    for m, s in layers:
        s.weight_cache = cast(s, m.weight)


def drop(layers: list) -> None:
    for _, s in layers:
        s.weight_cache = None

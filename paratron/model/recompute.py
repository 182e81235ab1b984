"""``--recompute-granularity selective --recompute-modules ...``: which submodules of each layer
recompute their activations in backward instead of keeping them (Megatron's names).

- ``core_attn`` (the default): the attention core (softmax(QK^T)V), checkpointed.
- ``mlp``: a dense layer's whole MLP; ``moe``: a mixture-of-experts layer's whole MoE block (router,
  dispatch, experts, shared expert); ``shared_experts``: the MoE block's shared expert. Checkpointed.
- ``layernorm``: the input and pre-MLP norms; ``moe_act``: the experts' activation (SwiGLU/GeLU).
  Their outputs are discarded once the next matmul has saved them and recomputed from the norm's
  (activation's) input when that matmul's backward needs them (Megatron's output-discarding checkpoint).
The gradients are the ones of the run without recomputation: only memory and time change.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..config.values import RECOMPUTE_MISSING as MISSING, RECOMPUTE_SUPPORTED as SUPPORTED  # noqa: F401 (the names)


def recomputing() -> bool:
    """Whether this forward code runs as the recomputation inside a backward pass (side effects such
    as the router's statistics must not count it twice)."""
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("paratron::counted", mutates_args=())
def counted(like: torch.Tensor) -> torch.Tensor:
    """1.0 (a 0-dim fp32 tensor on ``like``'s device) in a forward pass, 0.0 when it runs as a recomputation
    inside a backward pass: what a running sum (the router's losses and token counts) multiplies its addend
    by. An operator of its own, so that a compiled layer asks at run time (no graph break, no recompilation,
    no host read of a device value) instead of tracing :func:`recomputing` once."""
    return torch.full((), 0.0 if recomputing() else 1.0, device=like.device)


@counted.register_fake
def _counted_fake(like: torch.Tensor) -> torch.Tensor:
    return torch.empty((), device=like.device)


def active(module: torch.nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


class _Discard:
    """Saved-tensor hooks that store a recipe instead of ``out`` (the result of ``fn(x)``) or of a view
    of it (a matmul saves its input flattened to 2-D) and redo ``fn(x)`` when backward unpacks it."""

    def __init__(self, fn: Callable, x: torch.Tensor, out: torch.Tensor):
        self.fn, self.x = fn, x
        self.storage = _storage(out)
        self.layout = (tuple(out.shape), out.stride(), out.storage_offset())
        self.again = None

    def pack(self, t: torch.Tensor):
        if self.storage is None or _storage(t) != self.storage:
            return t
        return self, tuple(t.shape), t.stride(), t.storage_offset()

    def unpack(self, v):
        if not (isinstance(v, tuple) and v and v[0] is self):
            return v
        if self.again is None:  # once per backward, however many consumers saved it
            with torch.no_grad():
                again = self.fn(self.x)
            shape, stride, offset = self.layout
            self.again = torch.as_strided(again, shape, stride, again.storage_offset())
        _, shape, stride, offset = v
        return torch.as_strided(self.again, shape, stride, self.again.storage_offset() + offset - self.layout[2])


def _storage(t: torch.Tensor):
    if t.device.type == "meta" or not t.is_floating_point():
        return None
    return t.untyped_storage().data_ptr(), t.dtype, t.device


def discard_output(fn: Callable, x: torch.Tensor, consume: Callable):
    """``consume(fn(x))`` where ``fn(x)`` is not kept for backward: whatever ``consume`` saves of it is
    recomputed from ``x`` when needed. ``fn`` must be deterministic (a norm, an activation)."""
    out = fn(x)
    hooks = _Discard(fn, x.detach(), out)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        return consume(out)


def apply(stack, modules) -> None:
    """Mark the submodules of ``stack``'s layers that ``modules`` (a resolved --recompute-modules list)
    names; called for --recompute-granularity selective."""
    from .layers import MLP, Attention
    from .moe import MoELayer
    names = set(modules)
    for layer in stack.layers:
        if isinstance(layer.self_attention, Attention):
            layer.self_attention.recompute_core = "core_attn" in names
        layer.recompute_norms = "layernorm" in names
        moe = isinstance(layer.mlp, MoELayer)
        layer.recompute_mlp = ("moe" in names) if moe else ("mlp" in names and isinstance(layer.mlp, MLP))
        if moe:
            layer.mlp.recompute_shared = "shared_experts" in names
            layer.mlp.experts.recompute_act = "moe_act" in names


def saved_storage_bytes(run: Callable, skip=()) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saves for backward while ``run()`` runs, its result), the
    storages of the tensors in ``skip`` (a layer's weights) left out: what recomputation trades (tests and
    benchmarks/matmul_shapes.py measure it)."""
    seen, total = {t.untyped_storage().data_ptr() for t in skip}, [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total[0] += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return total[0], out

"""``--recompute-granularity selective --recompute-modules ...``: which submodules of each layer
recompute their activations in backward instead of keeping them (Megatron's names).

- ``core_attn`` (the default): the attention core (softmax(QK^T)V), checkpointed.
- ``mlp``: a dense layer's whole MLP; ``moe``: a mixture-of-experts layer's whole MoE block (router,
  dispatch, experts, shared expert); ``shared_experts``: the MoE block's shared expert. Checkpointed.
- ``layernorm``: the input and pre-MLP norms; ``moe_act``: the experts' activation (SwiGLU/GeLU);
  ``mla_up_proj``: multi-latent attention's up projections and rotary embedding (the per-head queries, keys
  and values, from the compressed latents). Their outputs are discarded once the next operation (the matmul,
  the attention core) has saved them and recomputed from their inputs when its backward needs them
  (Megatron's output-discarding checkpoint).
The gradients are the ones of the run without recomputation: only memory and time change.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..config.values import RECOMPUTE_MISSING as MISSING, RECOMPUTE_SUPPORTED as SUPPORTED  # noqa: F401 (the names)
from . import activation_offload


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
    """Saved-tensor hooks that store a recipe instead of an output of ``fn(*xs)`` (or a view of one: a matmul
    saves its input flattened to 2-D) and redo ``fn(*xs)`` when backward unpacks it."""

    def __init__(self, fn: Callable, xs: tuple, outs: tuple):
        self.fn, self.xs = fn, xs
        self.outputs: dict = {}  # storage -> (which output, its storage offset)
        for i, out in enumerate(outs):
            storage = _storage(out)
            if storage is not None:
                self.outputs.setdefault(storage, (i, out.storage_offset()))
        self.again = None

    def pack(self, t: torch.Tensor):
        hit = self.outputs.get(_storage(t))
        if hit is None:
            return t
        return self, hit[0], tuple(t.shape), t.stride(), t.storage_offset() - hit[1]

    def unpack(self, v):
        if not (isinstance(v, tuple) and v and v[0] is self):
            return v
        if self.again is None:  # once per backward, however many consumers saved it
            with torch.no_grad():
                again = self.fn(*self.xs)
            self.again = again if isinstance(again, tuple) else (again,)
        _, i, shape, stride, delta = v
        return torch.as_strided(self.again[i], shape, stride, self.again[i].storage_offset() + delta)


def _storage(t: torch.Tensor):
    if t.device.type == "meta" or not t.is_floating_point():
        return None
    return t.untyped_storage().data_ptr(), t.dtype, t.device


def discard_output(fn: Callable, x, consume: Callable):
    """``consume(fn(x))`` where ``fn(x)`` is not kept for backward: whatever ``consume`` saves of it is
    recomputed from ``x`` when needed. ``x`` may be a tuple of inputs (``fn(*x)``), and ``fn`` may return a
    tuple. ``fn`` must be deterministic (a norm, an activation, projections)."""
    xs = x if isinstance(x, tuple) else (x,)
    out = fn(*xs)
    hooks = _Discard(fn, tuple(t.detach() for t in xs), out if isinstance(out, tuple) else (out,))
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        return consume(out)


def apply_train_choices(stack, tr, device) -> None:
    """What a resolved train section asks of a decoder stack's layers: the --recompute-modules of selective
    recomputation, and --offload-modules (model/activation_offload.py)."""
    if tr.recompute_granularity == "selective":  # (resolved: default core_attn)
        apply(stack, tr.recompute_modules)
    if tr.fine_grained_activation_offloading:
        activation_offload.apply(stack, tr.offload_modules, tr.activation_offload_fraction,
                                 tr.min_offloaded_tensor_size, device)


def apply(stack, modules) -> None:
    """Mark the submodules of ``stack``'s layers that ``modules`` (a resolved --recompute-modules list)
    names; called for --recompute-granularity selective."""
    from .layers import MLP
    from .moe import MoELayer
    names = set(modules)
    for layer in stack.layers:
        if hasattr(layer.self_attention, "recompute_core"):  # (self-attention's, multi-latent attention's)
            layer.self_attention.recompute_core = "core_attn" in names
        layer.recompute_norms = "layernorm" in names
        moe = isinstance(layer.mlp, MoELayer)
        layer.recompute_mlp = ("moe" in names) if moe else ("mlp" in names and isinstance(layer.mlp, MLP))
        if moe:
            layer.mlp.recompute_shared = "shared_experts" in names
            layer.mlp.experts.recompute_act = "moe_act" in names
        if hasattr(layer.self_attention, "recompute_up"):  # multi-latent attention
            layer.self_attention.recompute_up = "mla_up_proj" in names


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

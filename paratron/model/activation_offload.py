"""``--fine-grained-activation-offloading --offload-modules ...`` (Megatron's flags): what chosen submodules of each
decoder layer save for backward is held in host memory between the forward and the backward.

The points (Megatron's names, in the order a layer runs them; each offloads what its module saves, its input
first of all):

    attn_norm    the norm before the attention or mixer (its input: the residual stream)
    qkv_linear   the attention's QKV projection (its input: the normed hidden states)
    core_attn    the attention core (q, k, v and what its kernel keeps: output, softmax statistics)
    attn_proj    the attention's output projection (its input: the core's output)
    mlp_norm     the norm before the MLP or MoE block
    expert_fc1   the routed experts' first matmul (its input: the permuted tokens)
    moe_act      the experts' activation (its input: fc1's output)

The attention points are those of paratron's self-attention (attention/self_attention.py); multi-latent
attention, Mamba and Gated DeltaNet layers offload their norms and MoE points only.

How: while an offloaded point runs, saved-tensor hooks replace each tensor autograd saves (parameters and tensors
under ``--min-offloaded-tensor-size`` elements excepted) with a host copy: on a GPU a pinned one, copied on a side
stream once the compute stream has produced the tensor (``record_stream`` keeps its memory from reuse until the
copy is done), so the device memory is free once the forward lets go of the tensor. In backward the first reload
of a group (one point of one layer in one forward pass) also starts, on the side stream, the reload of the group
saved before it in the same pass: the one backward needs next. A reload waits for its own copy only. The values
are copied, not changed: the loss and the gradients are those without offloading. On the CPU the host copies are
made too (what the CPU tests check), though they save nothing there.

``--activation-offload-fraction f``: of a model chunk's (layer, point) groups in forward order, the first
round(f x n) offload. (Megatron counts its groups after its size filter; here the size filter is per tensor.)
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

_NO_POINT = contextlib.nullcontext()


def at(module: nn.Module, name: str):
    """The context that offloads what ``module``'s point ``name`` saves while it runs (a no-op context where
    the point is not offloaded)."""
    points = module.__dict__.get("offload_points")
    return points[name]() if points and name in points else _NO_POINT


@dataclass
class Entry:
    """One offloaded tensor: its host copy, the event of that copy (CUDA), and its reload started ahead."""
    host: torch.Tensor
    device: torch.device
    copied: Optional[torch.cuda.Event] = None
    ahead: Optional[tuple] = None  # (device tensor, event) of a prefetch


@dataclass
class Group:
    """The tensors one point of one layer saved in one forward pass (weak references: autograd's graph owns the
    entries, so nothing outlives it), and the group saved before it."""
    previous: Optional["Group"]
    entries: list = field(default_factory=list)
    reloading: bool = False


class Offloader:
    """The offloading of one model chunk: its side stream (CUDA) and the chain of groups of the forward pass under
    way. ``offloaded_bytes`` / ``prefetched_bytes``: bytes copied to the host so far, and of them reloaded ahead
    of their use (the tests read them)."""

    def __init__(self, min_elems: int, device: torch.device, params: set):
        self.min_elems, self.params = min_elems, params
        self.cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.last: Optional[Group] = None
        self.offloaded_bytes = self.prefetched_bytes = 0

    def new_pass(self, *_) -> None:
        """A forward pass of the chunk begins (its first group has no previous one)."""
        self.last = None

    def group(self):
        """The saved-tensor hooks of a new group, entered while its point runs."""
        g = Group(self.last)
        self.last = g
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(g, t), lambda e: self._unpack(g, e))

    def _pack(self, g: Group, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.numel() < self.min_elems or t.data_ptr() in self.params or \
                (self.cuda and not t.is_cuda):  # (a host tensor a GPU layer saves stays where it is)
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=self.cuda)  # (a dense tensor's strides kept)
        entry = Entry(host, t.device)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                entry.copied = self.stream.record_event()
            t.record_stream(self.stream)
        else:
            host.copy_(t)
        g.entries.append(weakref.ref(entry))
        self.offloaded_bytes += t.numel() * t.element_size()
        return entry

    def _unpack(self, g: Group, entry):
        if not isinstance(entry, Entry):
            return entry
        if not g.reloading:  # backward reached this group: bring the one it needs next back meanwhile
            g.reloading = True
            if g.previous is not None:
                self._prefetch(g.previous)
        return self._reload(entry)

    def _prefetch(self, g: Group) -> None:
        """Start the reload of ``g``'s tensors (on a GPU on the side stream, after their copies to the host)."""
        for ref in g.entries:
            entry = ref()
            if entry is not None and entry.ahead is None:
                if not self.cuda:
                    entry.ahead = (entry.host, None)
                    continue
                with torch.cuda.stream(self.stream):
                    dev = entry.host.to(entry.device, non_blocking=True)
                    entry.ahead = (dev, self.stream.record_event())

    def _reload(self, entry: Entry) -> torch.Tensor:
        """``entry``'s tensor on its device: the prefetched one, else copied now on the compute stream."""
        if entry.ahead is not None:
            (dev, ready), entry.ahead = entry.ahead, None
            self.prefetched_bytes += dev.numel() * dev.element_size()
            if self.cuda:
                main = torch.cuda.current_stream(entry.device)
                main.wait_event(ready)
                dev.record_stream(main)  # (allocated on the side stream, used on this one)
            return dev
        if not self.cuda:
            return entry.host
        main = torch.cuda.current_stream(entry.device)
        main.wait_event(entry.copied)
        return entry.host.to(entry.device, non_blocking=True)


def points_of(layer) -> list[tuple[nn.Module, str]]:
    """(module, point) of a decoder layer, in the order it runs them."""
    from .attention.self_attention import Attention
    from .moe import MoELayer
    out = []
    if layer.input_layernorm is not None:
        out.append((layer, "attn_norm"))
    if isinstance(layer.self_attention, Attention):
        out += [(layer.self_attention, name) for name in ("qkv_linear", "core_attn", "attn_proj")]
    if layer.pre_mlp_layernorm is not None:
        out.append((layer, "mlp_norm"))
    if isinstance(layer.mlp, MoELayer):
        out += [(layer.mlp.experts, name) for name in ("expert_fc1", "moe_act")]
    return out


def apply(stack, modules: list, fraction: float, min_elems: int, device) -> Offloader:
    """Offload the points ``modules`` names in ``stack``'s layers (a resolved --offload-modules list), the first
    ``fraction`` of the (layer, point) groups in forward order."""
    params = {p.data_ptr() for p in stack.parameters()}
    off = Offloader(min_elems, torch.device(device), params)
    chosen = [(m, name) for layer in stack.layers for m, name in points_of(layer) if name in modules]
    for m, name in chosen[:round(fraction * len(chosen))]:
        m.__dict__.setdefault("offload_points", {})[name] = off.group
    stack.register_forward_pre_hook(off.new_pass)
    stack.offloader = off
    return off

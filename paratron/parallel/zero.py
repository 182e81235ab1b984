"""Sharded gradients and parameters (ZeRO-2 and ZeRO-3, ``--use-megatron-fsdp`` with
``--data-parallel-sharding-strategy optim_grads | optim_grads_params``) on top of the gradient buffers of
paratron/parallel/data.py.

Storage. Under ZeRO-2 a bucket's full gradient (``Bucket.grad_full``, where the parameters' ``main_grad``
views point) exists only from its first gradient of a step to the end of its reduce-scatter; what stays is
this rank's shard of the reduced gradient (``GradBuffer.grad_shard_data``). Under ZeRO-3 a bucket's full
parameters (``Bucket.param_full``, where ``param.data`` points) exist only while a unit that uses them runs
forward or backward; what stays is this rank's shard (``GradBuffer.param_shard_data``), which the
distributed optimizer updates. Freeing resizes the tensor's storage to zero bytes and gathering resizes it
back: every view (``param.data``, ``main_grad``, the tensors autograd saved for backward) stays valid.

Units (ZeRO-3). Each element of a top-level ``nn.ModuleList`` of the model (a transformer layer, an MTP
layer) is a unit; the rest of the model (embeddings, final norm, output layer) is the root unit. In
ZeRO-3 the buckets are cut at unit boundaries, so a bucket belongs to one unit. A unit's buckets are
all-gathered before its forward and freed after it; gathered again when the gradient of its output
arrives in backward (a hook on the output tensor) and freed once every parameter of the unit has its
gradient. Under gradient accumulation this happens in every micro-batch (the parameters are never kept
gathered between micro-batches: the memory ZeRO-3 is for). A forward that runs inside backward (activation
recomputation) gathers and does not free: the backward that follows needs the parameters. With
--overlap-param-gather a unit's forward also starts the all-gather of the next unit in the background (its
backward: of the previous unit), and that unit waits for it when it starts.
"""
from __future__ import annotations

import torch
from torch import nn


def is_free(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() == 0


def free(t: torch.Tensor) -> None:
    """Release ``t``'s memory; its views stay (reading them before ``allocate`` is an error)."""
    t.untyped_storage().resize_(0)


def allocate(t: torch.Tensor) -> bool:
    """Give ``t`` (a base tensor) its memory back, uninitialised; False when it had it."""
    if not is_free(t):
        return False
    t.untyped_storage().resize_(t.numel() * t.element_size())
    return True


def find_units(root: nn.Module) -> list[nn.Module]:
    """The root, then every element of a top-level ``nn.ModuleList`` (not looking inside those)."""
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                units.extend(child)
            else:
                visit(child)
    visit(root)
    return [root] + units


def unit_index(root: nn.Module, params: list) -> dict:
    """{parameter: index of its unit in find_units(root)} (0: the root unit)."""
    out = {}
    for i, u in enumerate(find_units(root)[1:], start=1):
        for p in u.parameters():
            out.setdefault(p, i)
    return {p: out.get(p, 0) for p in params}


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _first_grad_tensor(output):
    if torch.is_tensor(output):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for o in output:
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    return None


class ParamUnits:
    """The per-unit hooks of one DataParallel (see the module doc). ZeRO-3 (``params_sharded``): gather and
    free the parameters. ZeRO-2 and 3: give a unit's gradient buckets their storage when its backward
    starts, so that the weight-gradient GEMMs add into ``main_grad`` (gradient-accumulation fusion)."""

    def __init__(self, root: nn.Module, bucket_of: dict, units_of: dict, params_sharded: bool,
                 prefetch: bool = False):
        """``prefetch`` (--overlap-param-gather): a unit's forward starts the gather of the next unit's
        parameters in the background, its backward that of the previous unit."""
        self.units = find_units(root)
        self.params_sharded, self.prefetch = params_sharded, prefetch
        self.buckets = [sorted({bucket_of[p] for p in units_of if units_of[p] == i and bucket_of[p].buffer.level >= 2},
                               key=lambda b: -b.index) for i in range(len(self.units))]
        self.params = [[p for p in units_of if units_of[p] == i] for i in range(len(self.units))]
        self.unit_of = units_of
        self.pending: list = [None] * len(self.units)  # parameters whose gradient this backward still owes
        self.gathers = 0  # bucket all-gathers run at once (a count for tests and logs)
        self.prefetches = 0  # units whose gather was started ahead
        self.handles = []
        for i, u in enumerate(self.units):
            if not self.buckets[i]:
                continue
            if params_sharded:
                pre = torch._dynamo.disable(lambda _m, _a, i=i: self.gather(i, 0 if in_backward() else i + 1))
                self.handles.append(u.register_forward_pre_hook(pre))
            post = torch._dynamo.disable(lambda _m, _a, out, i=i: self._after_forward(i, out))
            self.handles.append(u.register_forward_hook(post))

    def gather(self, i: int, then: int = 0) -> None:
        """Unit ``i``'s parameters, now; with ``prefetch``, start those of unit ``then`` (not the root)."""
        for b in self.buckets[i]:
            if b.buffer.level == 3:
                self.gathers += b.buffer.gather_params(b)
        if self.prefetch and 0 < then < len(self.units):
            started = [b.buffer.gather_params(b, async_op=True) for b in self.buckets[then] if b.buffer.level == 3]
            self.prefetches += any(started)

    def release(self, i: int) -> None:
        for b in self.buckets[i]:
            if b.buffer.level == 3:
                b.buffer.free_params(b)

    def free_all(self) -> None:
        """Drop every gathered parameter (after the optimizer step they are stale)."""
        for i in range(len(self.units)):
            self.release(i)
            self.pending[i] = None

    def gather_all(self) -> None:
        for i in range(len(self.units)):
            self.gather(i)

    def _after_forward(self, i: int, output) -> None:
        t = _first_grad_tensor(output)
        if t is not None:
            t.register_hook(lambda g, i=i: self._before_backward(i))
        if self.params_sharded and not in_backward():
            self.release(i)

    def _before_backward(self, i: int) -> None:
        for b in self.buckets[i]:
            b.buffer.ensure_grads(b)
        if self.params_sharded:
            self.gather(i, i - 1)
            self.pending[i] = set(self.params[i])

    def on_grad(self, p) -> None:
        """A parameter's gradient of this backward is in: free its unit's parameters after the last one."""
        i = self.unit_of[p]
        pending = self.pending[i]
        if pending is None:
            return
        pending.discard(p)
        if not pending:
            self.pending[i] = None
            self.release(i)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def shard_views(buffer, p) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(first flattened element, gradient view, parameter view) of the part of ``p`` in this rank's shard
    of its bucket (none or one), in the buffer's shard storage."""
    start = buffer.offsets[p]
    for b in buffer.buckets:
        if any(q is p for q in b.params):
            lo, hi = b.shard_range()
            a, z = max(lo, start), min(hi, start + p.numel())
            if a >= z:
                return []
            return [(a - start, buffer.grad_shard(b)[a - lo: z - lo], buffer.param_shard(b)[a - lo: z - lo])]
    raise KeyError("parameter not in this buffer")


def grad_views(buffer, p) -> list[torch.Tensor]:
    """The tensors holding ``p``'s reduced gradient on this rank: its whole ``main_grad`` unless gradients
    are sharded (then the part in this rank's shard, if any)."""
    if buffer.level < 2:
        return [p.main_grad]
    return [g for _, g, _ in shard_views(buffer, p)]


def sharded_model_views(models: list) -> dict:
    """{parameter: [(first flattened element, view)]} of the parameters held only as shards (ZeRO-3), for
    checkpoints; parameters held whole are absent."""
    out = {}
    for m in models:
        for buf in getattr(m, "grad_buffers", ()):
            if buf.level == 3:
                for p in buf.params:
                    out[p] = [(s, v) for s, _, v in shard_views(buf, p)]
    return out

"""``--fp8-param-gather``: the parameter all-gather of the distributed optimizer (ZeRO-1/2 after the step,
ZeRO-3 before each unit's forward and backward) moves the FP8 linear weights in FP8 (one byte an element)
with one scale per weight, instead of their bf16 values.

The FP8 linear weights (those of layers with an FP8 recipe, paratron/fp8/linear.py) get gradient buffers of
their own, so an FP8 bucket holds only them. For each bucket: every rank takes the amax of its shard of each
weight, the amaxes are all-reduced (max) over the buffer's group, each weight's scale is Transformer Engine's
``fmax / amax`` (e4m3), every rank casts its shard with those scales, the FP8 bytes are all-gathered, and
each rank writes the dequantised weights into the bucket's parameters. The bf16/fp32 masters (the
optimizer's shards) stay the source of truth: the gathered weights are their FP8 casts, which is what the
FP8 GEMMs read (with the tensorwise recipe the layer's own cast of them gives the same FP8 values; with the
delayed recipe its history scale re-casts them). These buckets are gathered at once, also with
--overlap-param-gather (the other buckets still overlap with the forward).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from ..kernels.fp8_cast import E4M3, FMAX, compute_scale, dequantize, quantize


def fp8_weights(module: torch.nn.Module) -> set:
    """The weights of the linear layers that run in FP8 (an FP8State attached)."""
    return {m.weight for m in module.modules() if getattr(m, "fp8", None) is not None}


def _ranges(buffer, b):
    """(parameter, [a, z) in its bucket's shard coordinates, [a, z) in the bucket's coordinates) of each
    parameter's part in this rank's shard."""
    lo, hi = b.shard_range()
    for p in b.params:
        start = buffer.offsets[p]
        a, z = max(lo, start), min(hi, start + p.numel())
        yield p, (a - lo, z - lo) if a < z else None, (start - b.start, start - b.start + p.numel())


def scales(buffer, b) -> torch.Tensor:
    """The e4m3 scale of each weight of bucket ``b`` (in b.params order) from its amax over the group."""
    shard = buffer.param_shard(b)
    amax = torch.zeros(len(b.params), dtype=torch.float32, device=shard.device)
    for j, (_, mine, _) in enumerate(_ranges(buffer, b)):
        if mine is not None:
            amax[j] = shard[mine[0]: mine[1]].detach().abs().amax().float()
    if buffer.n > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=buffer.group)
    return compute_scale(amax, FMAX[E4M3])


def quantize_shard(buffer, b, s: torch.Tensor) -> torch.Tensor:
    """This rank's shard of bucket ``b`` in e4m3, each weight's part cast with its scale (padding 0)."""
    shard = buffer.param_shard(b)
    q = torch.zeros(shard.numel(), dtype=E4M3, device=shard.device)
    for j, (_, mine, _) in enumerate(_ranges(buffer, b)):
        if mine is not None:
            q[mine[0]: mine[1]] = quantize(shard[mine[0]: mine[1]].detach(), s[j], E4M3)
    return q


@torch.no_grad()
def gather(buffer, b, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather bucket ``b`` in FP8 and write the dequantised weights into ``out`` (the bucket's full
    parameters). Returns (the gathered FP8 bucket, the scales)."""
    s = scales(buffer, b)
    q = quantize_shard(buffer, b, s)
    full = torch.empty(b.numel, dtype=torch.uint8, device=q.device)
    comm.all_gather_single(full, q.view(torch.uint8), group=buffer.group)  # (gloo has no FP8 type: its bytes)
    full = full.view(E4M3)
    for j, (p, _, (a, z)) in enumerate(_ranges(buffer, b)):
        out[a: z] = dequantize(full[a: z], s[j], out.dtype)
    return full, s

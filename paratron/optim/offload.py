"""Optimizer CPU offload (Megatron's ``--optimizer-cpu-offload`` and ``--optimizer-offload-fraction``).

The fp32 master weights and the Adam moments of a fraction of the masters (by elements, in the optimizer's
order) live in host memory (pinned when the model is on a GPU). Each step the (unscaled, clipped)
gradients of those masters are copied to the host, AdamW updates them there, and the updated masters are
copied back into the model weights (or their distributed-optimizer shard) before the parameter
all-gather. The global gradient norm, the skip on inf/nan and the clipping run on the device copies as
without offload. The checkpoint does not change: the same tensors under the same names, wherever they
live, so a run with offload saves a checkpoint that loads without it and the reverse.
"""
from __future__ import annotations

import torch


def host_indices(masters: list[torch.Tensor], adam_index: list[int], fraction: float) -> list[int]:
    """The Adam-stepped masters to offload: in order, while the elements offloaded before each stay under
    ``fraction`` of the total."""
    total = sum(masters[i].numel() for i in adam_index)
    out, done = [], 0
    for i in adam_index:
        if done < fraction * total:
            out.append(i)
            done += masters[i].numel()
    return out


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of ``t`` in host memory, pinned when ``t`` is on a GPU (fast, asynchronous copies)."""
    out = torch.empty(t.shape, dtype=torch.float32, device="cpu", pin_memory=t.device.type == "cuda")
    with torch.no_grad():
        out.copy_(t)
    return out


class HostState:
    """The offloaded masters of one optimizer: which they are, their host gradient buffers, and the
    copies to and from the device."""

    def __init__(self, masters: list[torch.Tensor], indices: list[int]):
        self.indices = indices
        self.device_of = {i: masters[i].device for i in indices}
        for i in indices:
            masters[i] = host_copy(masters[i])
        self.grads = {i: torch.empty_like(masters[i]) for i in indices}  # pinned like the master

    def bytes(self, masters: list[torch.Tensor]) -> int:
        return sum(masters[i].numel() * masters[i].element_size() for i in self.indices)

    def grads_to_host(self, grads: list[torch.Tensor]) -> dict:
        """{index: host gradient} of the offloaded masters (one synchronisation after the copies)."""
        for i in self.indices:
            self.grads[i].copy_(grads[i], non_blocking=True)
        if any(d.type == "cuda" for d in self.device_of.values()):
            torch.cuda.synchronize()
        return self.grads

    @torch.no_grad()
    def copy_back(self, masters: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """The updated host masters into their model tensors (``targets``: per master, the model tensor)."""
        for i in self.indices:
            targets[i].copy_(masters[i], non_blocking=True)

    @torch.no_grad()
    def reload(self, masters: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        """The host masters from the model tensors (after loading weights into them)."""
        for i in self.indices:
            masters[i].copy_(sources[i])


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i: one foreach copy per device pair that has one (an offloaded
    master and its model tensor are on different devices)."""
    groups: dict = {}
    for d, s in zip(dst, src):
        groups.setdefault((d.device, s.device), ([], []))
        groups[(d.device, s.device)][0].append(d)
        groups[(d.device, s.device)][1].append(s)
    for (a, b), (ds, ss) in groups.items():
        if a == b:
            torch._foreach_copy_(ds, ss)
        else:
            for d, s in zip(ds, ss):
                d.copy_(s, non_blocking=True)


def norms(ts: list[torch.Tensor], device) -> torch.Tensor:
    """The L2 norm of each tensor in fp32 (bf16 / fp16 ones summed in fp32 as they are read), on ``device`` (one
    foreach norm per device the tensors are on)."""
    out = [None] * len(ts)
    by_device: dict = {}
    for i, t in enumerate(ts):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        for i, n in zip(idx, torch._foreach_norm([ts[i] for i in idx], 2, dtype=torch.float32)):
            out[i] = n.to(device)
    return torch.stack(out)

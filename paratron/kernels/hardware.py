"""What the device offers the optional kernels: a Hopper GPU in bf16 (quack's and FlashAttention-4's
kernels are built for compute capability 9.0)."""
from __future__ import annotations

import torch


def hopper_bf16(device, dtype) -> bool:
    """A module built on ``device`` in ``dtype`` may take an optional Hopper kernel: bf16 on a Hopper GPU."""
    if dtype != torch.bfloat16:
        return False
    device = torch.device(device) if device is not None else torch.device("cpu")
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def launches_dependent(device) -> bool:
    """Whether kernels on ``device`` can be launched for programmatic dependent launch (Hopper and later)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


def early_launch(pdl: bool, t: torch.Tensor) -> bool:
    """Whether a kernel asked to launch early (``pdl``) on ``t``'s device does: where that device can (Hopper and
    later); off CUDA (Triton's interpreter) as asked."""
    return pdl and (not t.is_cuda or launches_dependent(t.device))

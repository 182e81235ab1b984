"""FLOPs per iteration (Megatron's formula), MFU and device facts."""
from __future__ import annotations

from typing import Optional

import torch

from ..plan.flops import PEAK_TFLOPS, mla_attention_terms  # noqa: F401
from ..plan.flops import flops_per_iteration, hybrid_flops_per_iteration  # noqa: F401 (the planner's)


def peak_tflops(device: torch.device) -> Optional[float]:
    """Dense bf16 peak of this device, or None when unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def peak_memory_gb(device: torch.device) -> Optional[float]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    except Exception:  # pragma: no cover - non-POSIX
        return None

"""--log-energy: the energy each GPU used per iteration and its mean power, on Megatron's log line
(``energy per GPU (J/iter/GPU)``, ``power per GPU (W/GPU)``) and as TensorBoard's ``iter-energy/gpu`` and
``power/gpu``.

NVML counts each GPU's energy since the driver loaded (millijoules, ``nvmlDeviceGetTotalEnergyConsumption``); a
reading at each log line gives the window's energy, summed over the ranks and divided by the world size and the
window's iterations. The window is the log line's own (its time per iteration gives the power): evaluations and
checkpoint saves are left out of both (:meth:`EnergyMeter.pause` / :meth:`EnergyMeter.resume`), as Megatron's
interval timer and energy monitor leave them out. The GPU is found by its UUID, which holds under
``CUDA_VISIBLE_DEVICES``.

The counter advances in steps (tens of milliseconds apart, measured on an H100): a window shorter than a step
can read no rise at all. Such a window reports the GPU's power reading (``nvmlDeviceGetPowerUsage``) times its
time instead of zero, and its iterations and time stay in the next window, whose rise of the counter covers them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

NVML_MISSING = "--log-energy reads the GPU's energy counter through NVML: pip install nvidia-ml-py"


def nvml():
    """The NVML bindings (the ``pynvml`` module of nvidia-ml-py), or None."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class EnergyMeter:
    """The energy counter of this rank's GPU, read at each :meth:`lap`."""

    def __init__(self, device: torch.device, lib=None):
        self.lib = lib or nvml()
        if self.lib is None:
            raise RuntimeError(NVML_MISSING)
        self.lib.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        self.handle = self.lib.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        self.device, self.last = device, self._read()
        self.carried = (0, 0.0)  # (iterations, seconds) of windows in which the counter did not rise

    def _read(self) -> int:
        return int(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def pause(self) -> int:
        """The counter now: give it to :meth:`resume` to leave out what the GPU uses in between."""
        return self._read()

    def resume(self, paused: int) -> None:
        self.last += self._read() - paused

    def lap(self, iterations: int, seconds: float, world_size: int) -> tuple[float, float]:
        """(joules per GPU per iteration, watts per GPU) since the last lap, over every rank (a collective)."""
        now = self._read()
        iterations, seconds = max(iterations, 1), max(seconds, 1e-9)
        if now > self.last:
            n, t = iterations + self.carried[0], seconds + self.carried[1]
            joules, self.last, self.carried = (now - self.last) / 1000.0 / n, now, (0, 0.0)
            watts = joules * n / t
        else:  # the counter has not stepped since the last lap: the power reading (mW) now, and carry the window
            watts = self.lib.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
            joules, self.carried = watts * seconds / iterations, (iterations + self.carried[0],
                                                                  seconds + self.carried[1])
        both = torch.tensor([joules, watts], dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(both)
        joules, watts = (both / world_size).tolist()
        return joules, watts

    def close(self) -> None:
        self.lib.nvmlShutdown()

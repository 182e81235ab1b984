"""Do the GEMMs of a training step slow down when they run for a long time? The matmuls of one llama-1b
layer (forward, input gradient and weight gradient of QKV, proj, fc1 and fc2 at 32,768 tokens, the step's
operand layouts) run back to back for ``--seconds``; each window of ``--window`` seconds reports its TFLOP/s
and the SM clock (NVML, when importable). In the step these GEMMs run at ~700 TFLOP/s, alone at ~790
(benchmarks/results/perf_notes.md, tenth session): a falling clock here says power or heat, a flat one
says the step's operands or kernel choices.

    python benchmarks/gemm_sustained.py --seconds 6
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.matmul_shapes import shapes  # noqa: E402


def _clock_mhz():
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    except Exception:  # noqa: BLE001 - NVML absent: no clock column
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-1b")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--window", type=float, default=0.5)
    args = p.parse_args()
    n, dev, dt = args.tokens, "cuda", torch.bfloat16
    ops, flops = [], 0
    for name, fin, fout in shapes(args.config):
        if name == "output":
            continue
        x, w, dy = (torch.randn(*s, device=dev, dtype=dt) for s in ((n, fin), (fout, fin), (n, fout)))
        ops += [lambda x=x, w=w: x @ w.t(), lambda w=w, dy=dy: dy @ w, lambda x=x, dy=dy: dy.t() @ x]
        flops += 3 * 2 * n * fin * fout
    print(f"{torch.cuda.get_device_name()}: one {args.config} layer's GEMMs, {flops / 1e12:.2f} TFLOP per pass")
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        t0, passes = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.window:
            for op in ops:
                op()
            passes += 1
            torch.cuda.synchronize()
        dt_s = time.perf_counter() - t0
        clock = _clock_mhz()
        print(f"t={time.perf_counter() - start:5.1f} s  {passes * flops / dt_s / 1e12:6.0f} TFLOP/s"
              + (f"  SM clock {clock} MHz" if clock else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

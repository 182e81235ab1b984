"""Where the time of one training step goes on the GPU: torch profiler over a few steps of the real
Trainer, CUDA kernel time grouped by kind, plus the top kernels.

    python benchmarks/profile_step.py --config gpt-350m [extra flags...]
"""
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KINDS = [("attention", r"flash|fmha|sdpa|cudnn|attention"), ("matmul", r"gemm|cutlass|sm90_xmma|nvjet|matmul|wgmma"),
         ("optimizer", r"adam|foreach|multi_tensor"), ("cross-entropy", r"log_softmax|nll|cross_entropy|softmax"),
         ("norm", r"layer_norm|rms_norm|norm"), ("nccl", r"nccl"), ("copy/cast", r"copy|cast|memcpy|memset|fill")]


def kind_of(name: str) -> str:
    low = name.lower()
    for k, pat in KINDS:
        if re.search(pat, low):
            return k
    return "elementwise/other"


def main():
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    args = sys.argv[1:]
    cfg = parse_args(["--train-iters", "100", "--eval-iters", "0", "--log-interval", "1000000", *args])
    t = Trainer(cfg)
    for _ in range(4):
        t.train_step()
    torch.cuda.synchronize()
    steps = 3
    import time
    wall = time.perf_counter()
    for _ in range(steps):
        t.train_step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - wall) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t.train_step()
        torch.cuda.synchronize()
    totals, by_name = defaultdict(float), defaultdict(float)
    for e in prof.events():  # kernels only (operator rows would count the same time twice)
        if e.device_type != torch.autograd.DeviceType.CUDA or "#" in e.name:  # '#': user annotations
            continue
        dev = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
        totals[kind_of(e.name)] += dev
        by_name[e.name] += dev
    all_us = sum(totals.values())
    print("\ntop kernels:")
    for name, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {v / steps / 1000:8.2f} ms  {name[:110]}")
    print(f"\nstep wall time {wall * 1000:.1f} ms; GPU kernel time per step: {all_us / steps / 1000:.1f} ms "
          f"(GPU idle {100 * (1 - all_us / steps / 1e6 / wall):.0f} %)")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {k:20s} {v / steps / 1000:8.2f} ms  {100 * v / all_us:5.1f} %")
    out = os.environ.get("OUT")
    if out:
        prof.export_chrome_trace(str(Path(out) / "trace.json"))


if __name__ == "__main__":
    main()

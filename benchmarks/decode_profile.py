"""Where a decode step's time goes on the GPU: torch profiler over one generation (llama-1b shape,
random bf16 weights, paratron's engine with its compiled decode step replayed as a CUDA graph); per
generated token: wall time, GPU busy and idle time, kernels by kind and the top kernels.

    python benchmarks/decode_profile.py --batch 1 [--new-tokens 64] [--no-compile]

With $OUT set, the per-kernel table goes to $OUT/decode_kernels_b<batch>.tsv.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_bench import build, paratron_runner  # noqa: E402
from profile_step import idle_by_neighbours, kind_of, trace_kernels  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    device = torch.device("cuda")
    model, _, vocab, _ = build(False, device, torch.bfloat16)
    run = paratron_runner(model, vocab, not a.no_compile)
    prompts = torch.randint(0, vocab, (a.batch, a.prompt_len), device=device)
    n = a.new_tokens
    for _ in range(2):
        run(prompts, n)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(prompts, n)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        run(prompts, n)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        intervals = trace_kernels(trace)
    by_name, count, kinds = defaultdict(float), defaultdict(int), defaultdict(float)
    for s, e, name in intervals:
        by_name[name] += e - s
        count[name] += 1
        kinds[kind_of(name)] += e - s
    span = max(e for _, e, _ in intervals) - min(s for s, _, _ in intervals)
    _, idle = idle_by_neighbours(intervals)
    print(f"batch {a.batch}: {1000 * wall:.3f} ms per token unprofiled ({a.batch / wall:.0f} tokens/s); "
          f"profiled span {span / n / 1000:.3f} ms per token, GPU busy {(span - idle) / n / 1000:.3f}, "
          f"idle {idle / n / 1000:.3f} (prefill included)")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {k:30s} {v / n:8.1f} us per token")
    print("top kernels (us per token, launches per token):")
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])
    for k, v in rows[:30]:
        print(f"  {v / n:8.1f} us {count[k] / n:6.1f}x  {k[:130]}")
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / f"decode_kernels_b{a.batch}.tsv", "w") as f:
            f.write("us_per_token\tlaunches_per_token\tkind\tkernel\n")
            for k, v in rows:
                f.write(f"{v / n:.2f}\t{count[k] / n:.2f}\t{kind_of(k)}\t{k}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

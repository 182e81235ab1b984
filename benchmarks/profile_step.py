"""Where the time of one training step goes on the GPU: torch profiler over a few steps of the real
Trainer; CUDA kernel time grouped by kind, the top kernels with their launches per step, and the
time the GPU had no kernel running, all from the device timestamps in the profiler's Chrome trace
(the stretches covered by no kernel, memset or memcpy).

    python benchmarks/profile_step.py --config gpt-350m [extra flags...]
    python benchmarks/profile_step.py --decode --batch 1 [--new-tokens 64] [--no-compile]

``--decode``: where a decode step's time goes instead: one generation (llama-1b shape, random bf16 weights,
paratron's engine with its compiled decode step replayed as a CUDA graph); per generated token: wall time, GPU
busy and idle time, kernels by kind and the top kernels, told apart by launch grid, each with its own duration and
its exposed share of the critical path (``exposed``: kernels launched early overlap the one before, so their own
durations overstate them) ($OUT/decode_kernels_b<batch>.tsv).

With $OUT set, the full per-kernel table goes to $OUT/kernels_<config>.tsv (and the Chrome trace
to $OUT/trace_<config>.json when PROFILE_TRACE=1; PROFILE_STEPS=N profiles N steps, default 3).
PROFILE_ORIGIN=<regex> also says which CPU operators (outermost first, with their input shapes) launched
the GPU work whose names match, e.g. PROFILE_ORIGIN='Memcpy DtoD|direct_copy' (the PROFILE_ORIGIN_TOP most
frequent chains, default 15).
"""
import json
import os
import re
import tempfile
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KINDS = [("attention", r"flash|fmha|sdpa|cudnn|attention"),
         ("norm", r"rmsnorm|layer_norm|rms_norm"),  # (before matmul: quack's norms are CUTLASS kernels too)
         ("matmul", r"gemm|cutlass|sm90_xmma|nvjet|matmul|wgmma|cublas"),
         ("optimizer", r"adam|foreach|multi_tensor"),
         ("nccl", r"nccl"),
         ("copy/cast", r"copy|cast|memcpy|memset|fill|cat"),
         ("embedding", r"embedding|index|scatter|gather"),
         ("triton reduction (norms, CE)", r"triton_(red|per)"),
         ("triton pointwise", r"triton_poi")]


def kind_of(name: str) -> str:
    low = name.lower()
    for k, pat in KINDS:
        if re.search(pat, low):
            return k
    return "other"


def idle_by_neighbours(kernels, n=12):
    """Stretches with no kernel running, summed by (kernel before, kernel after): the n largest
    totals as (total us, count, before, after), and the idle total."""
    by_pair, end, last = defaultdict(lambda: [0.0, 0]), None, None
    for s, e, name in sorted(kernels):
        if end is not None and s > end:
            by_pair[(last[:70], name[:70])][0] += s - end
            by_pair[(last[:70], name[:70])][1] += 1
        if end is None or e > end:
            end, last = e, name
    rows = sorted(((t, c, b, a) for (b, a), (t, c) in by_pair.items()), reverse=True)
    return rows[:n], sum(r[0] for r in rows)


def tally(intervals) -> tuple[dict, dict, dict]:
    """(us by kernel name, launches by kernel name, us by kind) of ``trace_kernels``' intervals."""
    by_name, count, kinds = defaultdict(float), defaultdict(int), defaultdict(float)
    for start, end, name in intervals:
        by_name[name] += end - start
        count[name] += 1
        kinds[kind_of(name)] += end - start
    return by_name, count, kinds


def exposed(intervals) -> dict:
    """us by kernel name that no kernel before it covers: each kernel's end past the latest end before it (and past
    its own start). Kernels launched early (programmatic dependent launch) start while the one before runs and wait
    for it, so their own durations overlap and overstate them; these shares do not overlap, sum to the GPU's busy
    time, and say how much of the critical path each kernel holds."""
    by_name, last = defaultdict(float), float("-inf")
    for start, end, name in sorted(intervals, key=lambda i: i[1]):
        by_name[name] += end - max(start, last)  # (sorted by end: never negative)
        last = end
    return by_name


def trace_kernels(path, grid: bool = False) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel, memset and memcpy on the GPU in a Chrome trace
    written by torch.profiler (the device's own timestamps); ``grid``: each kernel's name followed by its launch
    grid (one kernel run at several shapes, e.g. the row GEMV of each projection, then counts apart)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]

    def named(e):
        shape = e.get("args", {}).get("grid")
        return f"{e['name']} grid={shape}" if grid and e.get("cat") == "kernel" and shape else e["name"]
    return sorted((e["ts"], e["ts"] + e["dur"], named(e)) for e in events
                  if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e)


def launch_origins(path, pattern: str, steps: int, n: int = 15) -> list[tuple[float, str]]:
    """For the kernels / copies whose names match ``pattern``: the chain of CPU operators around the
    runtime or driver call that launched each (matched by the profiler's correlation ids, nested by time on the
    launching thread), counted per step, the n most frequent."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and re.search(pattern, e["name"])]
    # runtime calls and driver calls (cuBLASLt launches its kernels through the driver API: cuLaunchKernelEx)
    runtime = {e["args"].get("correlation"): e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    ops = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and "dur" in e:
            ops[e["tid"]].append(e)
    chains = defaultdict(int)
    for k in gpu:
        r = runtime.get(k.get("args", {}).get("correlation"))
        if r is None:
            continue
        around = sorted((o for o in ops[r["tid"]] if o["ts"] <= r["ts"] <= o["ts"] + o["dur"]), key=lambda o: o["ts"])
        chain = " > ".join(f"{o['name']}{o.get('args', {}).get('Input Dims', '')}" for o in around[-4:])
        chains[f"{k['name'][:40]} <- {chain or '(no operator)'}"] += 1
    return sorted(((c / steps, name) for name, c in chains.items()), reverse=True)[:n]


def main():
    if sys.argv[1:2] == ["--decode"]:
        return decode_main(sys.argv[1:])
    from paratron.config import parse_args
    from paratron.kernels.cublaslt import RETUNE_AT
    from paratron.train.loop import Trainer
    args = sys.argv[1:]
    cfg = parse_args(["--train-iters", "100", "--eval-iters", "0", "--log-interval", "1000000", *args])
    name = args[args.index("--config") + 1] if "--config" in args else "model"
    t = Trainer(cfg)
    for _ in range(RETUNE_AT):  # (cuBLASLt times each GEMM shape at its first and RETUNE_AT-th call: not profiled)
        t.train_step()
    torch.cuda.synchronize()
    steps = int(os.environ.get("PROFILE_STEPS", "3"))
    wall = time.perf_counter()
    for _ in range(steps):
        t.train_step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - wall) / steps
    origin = os.environ.get("PROFILE_ORIGIN")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU],
                                record_shapes=bool(origin)) as prof:
        for _ in range(steps):
            t.train_step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:  # the trace is kept only with PROFILE_TRACE=1 and $OUT
        keep = os.environ.get("PROFILE_TRACE") and os.environ.get("OUT")
        trace = Path(os.environ["OUT"] if keep else tmp) / f"trace_{name}.json"
        prof.export_chrome_trace(str(trace))
        intervals = trace_kernels(trace)
        top = int(os.environ.get("PROFILE_ORIGIN_TOP", "15"))
        origins = launch_origins(trace, origin, steps, top) if origin else []
    by_name, count, totals = tally(intervals)
    all_us = sum(totals.values())
    span = (max(e for _, e, _ in intervals) - min(s for s, _, _ in intervals)) / steps if intervals else 0.0
    gaps, gap_total = idle_by_neighbours(intervals)
    busy = span - gap_total / steps
    print(f"\n== {name}: {' '.join(args)}")
    print("top kernels (ms per step, launches per step):")
    for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  {v / steps / 1000:8.2f} ms {count[k] / steps:6.0f}x  {kind_of(k)[:12]:12s} {k[:120]}")
    print(f"\nstep wall time {wall * 1000:.1f} ms (unprofiled); profiled span per step {span / 1000:.1f} ms, "
          f"GPU busy {busy / 1000:.1f} ms -> idle {100 * (1 - busy / span):.1f} % of the span")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {k:30s} {v / steps / 1000:8.2f} ms  {100 * v / all_us:5.1f} %")
    print(f"idle: {gap_total / steps / 1000:.1f} ms per step; by the kernels around it (ms per step, stretches):")
    for g, c, before, after in gaps:
        print(f"  {g / steps / 1000:6.2f} ms {c / steps:5.0f}x  after {before}  before {after}")
    if origins:
        print(f"launched by (per step; PROFILE_ORIGIN={origin}):")
        for c, chain in origins:
            print(f"  {c:5.0f}x  {chain[:300]}")
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / f"kernels_{name}.tsv", "w") as f:
            f.write("ms_per_step\tlaunches_per_step\tkind\tkernel\n")
            for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]):
                f.write(f"{v / steps / 1000:.4f}\t{count[k] / steps:.1f}\t{kind_of(k)}\t{k}\n")
    t.close()



def decode_main(argv: list) -> int:
    """``--decode``: one generation of the llama-1b shape profiled (module docstring)."""
    import argparse
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_bench import build, paratron_runner
    p = argparse.ArgumentParser(description="where a decode step's time goes on the GPU")
    p.add_argument("--decode", action="store_true")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--kernel-decode-attention", choices=("auto", "triton", "fused", "sdpa"), default=None)
    p.add_argument("--model-args", default="", help="more paratron flags of the model, one string")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    model, _, vocab, _ = build(False, device, torch.bfloat16, attention=a.kernel_decode_attention,
                               extra=tuple(a.model_args.split()))
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
        intervals = trace_kernels(trace, grid=True)
    by_name, count, kinds = tally(intervals)
    critical = exposed(intervals)
    span = max(e for _, e, _ in intervals) - min(s for s, _, _ in intervals)
    _, idle = idle_by_neighbours(intervals)
    print(f"batch {a.batch}: {1000 * wall:.3f} ms per token unprofiled ({a.batch / wall:.0f} tokens/s); "
          f"profiled span {span / n / 1000:.3f} ms per token, GPU busy {(span - idle) / n / 1000:.3f}, "
          f"idle {idle / n / 1000:.3f} (prefill included)")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {k:30s} {v / n:8.1f} us per token")
    print("top kernels (us per token: own duration, exposed: not covered by the kernels before it; launches):")
    rows = sorted(by_name.items(), key=lambda kv: -critical[kv[0]])
    for k, v in rows[:30]:
        print(f"  {v / n:8.1f} us {critical[k] / n:8.1f} us {count[k] / n:6.1f}x  {k[:120]}")
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / f"decode_kernels_b{a.batch}.tsv", "w") as f:
            f.write("us_per_token\texposed_us_per_token\tlaunches_per_token\tkind\tkernel\n")
            for k, v in rows:
                f.write(f"{v / n:.2f}\t{critical[k] / n:.2f}\t{count[k] / n:.2f}\t{kind_of(k)}\t{k}\n")
    return 0



if __name__ == "__main__":
    sys.exit(main())

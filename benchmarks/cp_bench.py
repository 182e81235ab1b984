#!/usr/bin/env python
"""Context parallelism on GPUs: llama-1b at long sequences, CP 1 (one GPU) against CP 2 (two GPUs).

    python benchmarks/cp_bench.py [--config llama-1b] [--seqs 32768 65536 131072]
        [--flags "--recompute-granularity full --recompute-method uniform"] [--curve-steps 50]

Throughput (``--mode throughput``): for each sequence length, one sample of that length per step
(micro-batch 1, global batch 1), on 1 GPU at CP 1 and on 2 GPUs at CP 2 (each GPU holds half the
sequence); warm-up steps, then CUDA-synchronised wall time over the timed steps. Reported: step ms,
tokens/s per GPU (sequence / step time / GPUs), peak memory per GPU (the largest over the ranks),
or OOM. Targets: CP 2 trains a length at which CP 1 runs out of memory, and at the first length CP 2's
tokens/s per GPU is >= 85 % of CP 1's.

Loss curves (``--mode curves``): ``--curve-steps`` steps at ``--curve-seq`` logged every step, for
CP 1, CP 1 again (run-to-run noise), CP 1 with ``--no-bias-swiglu-fusion`` (a rounding-only change:
the bf16 noise reference) and CP 2. Verdict: CP 2's largest relative loss difference from CP 1 is
within twice the largest of the two references'.

Each run is ``torchrun --standalone --nproc-per-node G`` of this file in worker mode (the real
Trainer). Writes a Markdown record to --record-dir (default: $OUT if set, else benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402  (benchmarks/record.py)

SPEED_TARGET = 0.85
OOM_EXIT = 3


def worker(args) -> None:
    """One rank of one run (under torchrun): Trainer.train_step, timed; rank 0 writes the result."""
    import torch
    import torch.distributed as dist
    from paratron.config import parse_args
    from paratron.parallel.dims import shutdown_distributed
    from paratron.train.loop import Trainer
    world = int(os.environ.get("WORLD_SIZE", "1"))
    flags = ["--config", args.config, "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
             "--micro-batch-size", "1", "--global-batch-size", "1", "--context-parallel-size", str(world),
             "--train-iters", str(args.warmup + args.steps + 1), "--eval-iters", "0", "--log-interval", "1000000",
             *shlex.split(args.flags)]
    cfg = parse_args(flags)
    result = {"gpus": world, "seq": args.seq}
    cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # (CPU: a smoke test of the script)
    try:
        trainer = Trainer(cfg)
        losses, times = [], []
        for _ in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            report, _, _ = trainer.train_step()
            sync()
            times.append(time.perf_counter() - start)
            losses.append(float(report[0] / report[1]))
    except torch.OutOfMemoryError:
        Path(args.result).write_text(json.dumps(dict(result, oom=True)))
        os._exit(OOM_EXIT)  # the other ranks may wait in a collective: torchrun ends them
    step = sum(times[args.warmup:]) / max(len(times) - args.warmup, 1)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=trainer.device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if trainer.dims.rank == 0:
        result.update(step_ms=round(step * 1e3, 1), tok_s_per_gpu=round(args.seq / step / world),
                      peak_gb=round(peak.item(), 1), losses=losses)
        Path(args.result).write_text(json.dumps(result))
    trainer.close()
    shutdown_distributed()


def run(gpus: int, seq: int, steps: int, warmup: int, flags: str, args) -> tuple[dict, str]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
               str(Path(__file__).resolve()), "--worker", "--result", str(result), "--config", args.config,
               "--seq", str(seq), "--warmup", str(warmup), "--steps", str(steps), "--flags", flags]
        print("$ " + shlex.join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout)
        if result.is_file():
            return json.loads(result.read_text()), shlex.join(cmd)
        return {"gpus": gpus, "seq": seq, "error": f"exit {proc.returncode}"}, shlex.join(cmd)


def throughput(args) -> tuple[str, str, list]:
    rows = ["| sequence | CP (GPUs) | step ms | tokens/s per GPU | peak GiB per GPU |", "|---|---|---|---|---|"]
    res, cmds = {}, []
    for seq in args.seqs:
        for cp in (1, 2):
            r, cmd = run(cp, seq, args.steps, args.warmup, args.flags, args)
            res[(seq, cp)] = r
            cmds.append(cmd)
            state = "OOM" if r.get("oom") else r.get("error")
            rows.append(f"| {seq} | {cp} | {r.get('step_ms', state)} | {r.get('tok_s_per_gpu', '')} | "
                        f"{r.get('peak_gb', '')} |")
    largest = {cp: max([s for s in args.seqs if "tok_s_per_gpu" in res[(s, cp)]], default=None) for cp in (1, 2)}
    first = args.seqs[0]
    a, b = res[(first, 1)].get("tok_s_per_gpu"), res[(first, 2)].get("tok_s_per_gpu")
    ratio = b / a if a and b else None
    beyond = [s for s in args.seqs if res[(s, 1)].get("oom") and "tok_s_per_gpu" in res[(s, 2)]]
    lines = [f"largest sequence trained: CP 1 {largest[1]}, CP 2 {largest[2]}",
             f"CP 2 trains where CP 1 runs out of memory: {beyond or 'none of these lengths'} "
             f"({'met' if beyond else 'NOT met'})",
             (f"at {first}: CP 2 tokens/s per GPU = {100 * ratio:.1f} % of CP 1's (target >= "
              f"{100 * SPEED_TARGET:.0f} %: {'met' if ratio >= SPEED_TARGET else 'NOT met'})" if ratio else
              f"at {first}: speed ratio n/a (a run failed)")]
    return "\n".join(rows), "\n".join(f"- {x}" for x in lines), cmds


def rel_diff(ref: list, other: list) -> float:
    return max(abs(a - b) / abs(a) for a, b in zip(ref, other)) if ref and other else float("nan")


def curves(args) -> tuple[str, str, list]:
    runs = {"cp1": (1, args.flags), "cp1-again": (1, args.flags),
            "cp1-no-swiglu-kernel": (1, f"{args.flags} --no-bias-swiglu-fusion"), "cp2": (2, args.flags)}
    got, cmds = {}, []
    for name, (gpus, flags) in runs.items():
        r, cmd = run(gpus, args.curve_seq, args.curve_steps, 0, flags, args)
        got[name] = r.get("losses", [])
        cmds.append(cmd)
    ref = got["cp1"]
    noise = max(rel_diff(ref, got["cp1-again"]), rel_diff(ref, got["cp1-no-swiglu-kernel"]))
    cp2 = rel_diff(ref, got["cp2"])
    verdict = (f"- CP 2 vs CP 1: max relative loss difference {cp2:.2e}; bf16 noise reference {noise:.2e} "
               f"({'within' if cp2 <= 2 * noise else 'NOT within'} 2 x the reference)")
    rows = ["| step | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for i in range(max((len(v) for v in got.values()), default=0)):
        rows.append(f"| {i + 1} | " + " | ".join(f"{v[i]:.4f}" if i < len(v) else "" for v in got.values()) + " |")
    return "\n".join(rows), verdict, cmds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-1b")
    p.add_argument("--mode", choices=("both", "throughput", "curves"), default="both")
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--curve-seq", type=int, default=32768)
    p.add_argument("--curve-steps", type=int, default=50)
    p.add_argument("--flags", default="", help="extra training flags for every run (e.g. recomputation)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    body, facts, cmds = [], {}, []
    if args.mode in ("both", "throughput"):
        table, verdict, c = throughput(args)
        body += ["## Throughput and memory", "", table, "", verdict, ""]
        cmds += c
        facts["throughput method"] = (f"micro-batch 1 of each length, {args.warmup} warm-up + {args.steps} timed "
                                      "steps (CUDA-synchronised wall time)")
    if args.mode in ("both", "curves"):
        table, verdict, c = curves(args)
        body += [f"## Loss curves at {args.curve_seq} tokens", "", verdict, "", table, ""]
        cmds += c
    facts["flags"] = f"`{args.flags}`"
    facts["runs"] = "; ".join(f"`{c}`" for c in cmds)
    print("\n".join(body))
    write_record(args.record_dir, f"cp_bench_{args.config}", f"Context parallelism: {args.config}, CP 1 vs CP 2",
                 f"up to 2 x {device}", facts, "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())

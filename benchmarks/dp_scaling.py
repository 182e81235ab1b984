#!/usr/bin/env python
"""Data-parallel scaling: tokens/s of the real training step on 1 GPU and on N GPUs (default 2),
the N-GPU run with the distributed optimizer and overlapped gradient reduce / parameter gather.

    python benchmarks/dp_scaling.py [--config llama-1b] [--gpus 2] [--micro-batches 1]
        [--flags "--torch-compile"] [--dp-flags "..."]

Weak scaling: each GPU runs the same micro-batches per step (global batch = micro-batch size x
micro-batches x GPUs). Each run is `torchrun --standalone --nproc-per-node G` of this file in worker
mode: Trainer.train_step, warm-up steps, then CUDA-synchronised wall time over the timed steps.
The figure is scaling = tokens/s on N GPUs / (N x tokens/s on 1 GPU); the target is >= 95 %.
Writes a Markdown record (date, hardware, torch, commit, commands, table) to --record-dir (default:
$OUT if set, else benchmarks/results).
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
from record import write_record  # noqa: E402  (benchmarks/record.py)

DP_FLAGS = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
TARGET = 0.95


def worker(args) -> None:
    """One rank of a measurement (under torchrun)."""
    import torch
    import torch.distributed as dist
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    from paratron.parallel.dims import shutdown_distributed
    world = int(os.environ.get("WORLD_SIZE", "1"))
    flags = ["--config", args.config, "--train-iters", str(args.warmup + args.steps + 1), "--eval-iters", "0",
             "--log-interval", "1000000", *shlex.split(args.flags)]
    mbs = parse_args(flags, world_size=1).train.micro_batch_size  # (weak scaling: DP only)
    cfg = parse_args(flags + ["--global-batch-size", str(mbs * args.micro_batches * world)])
    trainer = Trainer(cfg)

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()

    for _ in range(args.warmup):
        trainer.train_step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        report, _, _ = trainer.train_step()
    sync()
    dt = (time.perf_counter() - start) / args.steps
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    if trainer.dims.rank == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        result = dict(gpus=world, step_ms=round(dt * 1e3, 1), tok_s=round(tokens / dt),
                      tok_s_per_gpu=round(tokens / dt / world), global_batch=cfg.train.global_batch_size,
                      optimizer_state_gb=round(trainer.optimizer.state_bytes() / 2**30, 2),
                      peak_mem_gb=round(peak, 1) if peak is not None else None,
                      loss=round(float(report[0] / report[1]), 3) if report[1] > 0 else None)
        Path(args.result).write_text(json.dumps(result))
    trainer.close()
    shutdown_distributed()


def measure(gpus: int, flags: str, args) -> tuple[dict, str]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
               str(Path(__file__).resolve()), "--worker", "--result", str(result), "--config", args.config,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--micro-batches", str(args.micro_batches),
               "--flags", flags]
        print("$ " + shlex.join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0 or not result.is_file():
            return {"gpus": gpus, "error": f"exit {proc.returncode}"}, shlex.join(cmd)
        return json.loads(result.read_text()), shlex.join(cmd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-1b")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per GPU per step")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--flags", default="", help="extra flags for every run, e.g. '--torch-compile'")
    p.add_argument("--dp-flags", default=DP_FLAGS, help="flags of the multi-GPU run only")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    one, cmd1 = measure(1, args.flags, args)
    many, cmdn = measure(args.gpus, f"{args.flags} {args.dp_flags}".strip(), args)
    scaling = many["tok_s"] / (args.gpus * one["tok_s"]) if "tok_s" in one and "tok_s" in many else None
    rows = ["| GPUs | flags | step ms | tokens/s | tokens/s/GPU | global batch | optimizer state GiB/GPU | peak GiB | loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r, flags in ((one, args.flags), (many, f"{args.flags} {args.dp_flags}".strip())):
        rows.append(f"| {r['gpus']} | `{flags}` | {r.get('step_ms')} | {r.get('tok_s')} | {r.get('tok_s_per_gpu')} | "
                    f"{r.get('global_batch')} | {r.get('optimizer_state_gb')} | {r.get('peak_mem_gb')} | {r.get('loss')} |"
                    + (f" error: {r['error']}" if "error" in r else ""))
    verdict = (f"scaling {100 * scaling:.1f} % of {args.gpus} x the 1-GPU tokens/s (target >= {100 * TARGET:.0f} %: "
               f"{'met' if scaling >= TARGET else 'NOT met'})" if scaling is not None else "scaling: n/a (a run failed)")
    table = "\n".join(rows)
    print("\n" + table + "\n\n" + verdict)
    write_record(args.record_dir, f"dp_scaling_{args.config}_{args.gpus}gpu",
                 f"Data-parallel scaling: {args.config}, 1 -> {args.gpus} GPUs", f"{args.gpus} x {device}",
                 {"runs": f"`{cmd1}` and `{cmdn}`",
                  "method": f"weak scaling, {args.micro_batches} micro-batch(es) per GPU per step, {args.warmup} "
                            f"warm-up + {args.steps} timed steps (CUDA-synchronised wall time)"},
                 f"{table}\n\n{verdict}")
    return 0 if scaling is not None and scaling >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())

"""Host synchronisations of the training loop, per iteration, on a GPU.

    python benchmarks/host_sync.py --config llama-1b --flags "--torch-compile --micro-batch-size 4" [--iters 12]

Runs ``Trainer.train()`` (the real loop: step, skips, log line, exit checks) with a log interval of
``--log-interval`` and, after the warm-up iterations, CUDA's sync debug mode on: every operation
that makes the host wait for the GPU (``.item()``, ``cudaStreamSynchronize``, a blocking copy to
the host) raises a warning, counted against the iteration whose step or loop body it happened in.
An iteration that is not a log iteration should count 0. Writes a Markdown record (record.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import write_record  # noqa: E402  (benchmarks/record.py)


def count_syncs(preset: str, flags: list[str], iters: int, warmup: int, log_interval: int):
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    cfg = parse_args(["--config", preset, "--train-iters", str(iters), "--eval-iters", "0",
                      "--log-interval", str(log_interval), *flags])
    trainer = Trainer(cfg)
    per_iter: Counter = Counter()
    where: dict = {}
    current = [0]  # the iteration whose step, or whose loop body after the step, is running
    inner = trainer.train_step

    def step():
        current[0] = trainer.iteration + 1
        out = inner()
        if current[0] == warmup:  # on from here (anything the switch itself reports counts as warm-up)
            torch.cuda.set_sync_debug_mode("warn")
        return out

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            per_iter[current[0]] += 1
            # name the innermost frame of paratron's own code that led to it
            ours = [f for f in traceback.extract_stack() if "/paratron/" in f.filename and "host_sync" not in f.filename]
            at = ours[-1] if ours else None
            where.setdefault(current[0], set()).add(
                f"{Path(at.filename).name}:{at.lineno}" if at else f"{Path(filename).name}:{lineno}")

    trainer.train_step = step
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.close()
    return per_iter, where


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-1b")
    p.add_argument("--flags", default="--torch-compile")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    per_iter, where = count_syncs(args.config, args.flags.split(), args.iters, args.warmup, args.log_interval)
    lines = ["| iteration | log iteration | host syncs | where |", "|---|---|---|---|"]
    bad = 0
    for it in range(args.warmup + 1, args.iters + 1):
        is_log = it % args.log_interval == 0
        n = per_iter.get(it, 0)
        bad += n if not is_log else 0
        lines.append(f"| {it} | {'yes' if is_log else 'no'} | {n} | {', '.join(sorted(where.get(it, ())))} |")
    table = "\n".join(lines)
    print(table)
    print(f"host syncs outside log iterations: {bad}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_record(args.record_dir, f"host_sync_{args.config}", f"Host synchronisations per iteration: {args.config}",
                 device, {"flags": args.flags, "method": "torch.cuda.set_sync_debug_mode('warn') around each "
                          f"Trainer.train_step after {args.warmup} warm-up iterations, log interval "
                          f"{args.log_interval}", "syncs outside log iterations": str(bad)}, table)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a checkpoint costs the training loop, on one device: step time while an ``--async-save``
runs in the background versus step time without saving, the time the save blocks the loop (the
copy to pinned CPU memory), the synchronous save time, and a resume check.

    python benchmarks/checkpoint_overhead.py --config gpt-350m --flags "--torch-compile --micro-batch-size 8"

Method: warm-up steps, then every step timed on its own (CUDA-synchronised wall time). Baseline:
``--steps`` steps without saving. Async: ``save()`` is called (its blocking time is the staging
copy), then steps are timed until the background write has finished, at least ``--steps`` of
them; the steps that ran while the write was in flight are compared with the baseline. Done twice:
the first async save also allocates the pinned buffers. Then a synchronous save, and a fresh
trainer resumes from the last checkpoint: its next losses are compared with the original run's.
Writes a Markdown record to --record-dir (default: $OUT if set, else benchmarks/results).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import write_record  # noqa: E402  (benchmarks/record.py)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(t) -> tuple[float, float]:
    sync()
    start = time.perf_counter()
    report, _, _ = t.train_step()
    sync()
    return time.perf_counter() - start, float(report[0] / report[1])


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt-350m")
    p.add_argument("--flags", default="", help="extra training flags")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    from paratron.config import parse_args
    from paratron.train.loop import Trainer

    save_dir = Path(args.save_dir or tempfile.mkdtemp(prefix="paratron_ckpt_bench_"))
    flags = ["--config", args.config, "--train-iters", "100000", "--eval-iters", "0", "--log-interval", "1000000",
             "--save", str(save_dir), "--async-save", "--ckpt-keep-last", "1", *args.flags.split()]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__} on {device}; {' '.join(flags)}", flush=True)
    t = Trainer(parse_args(flags))
    for _ in range(args.warmup):
        timed_step(t)
    base = [timed_step(t)[0] for _ in range(args.steps)]
    rows = [("no save", statistics.mean(base), statistics.median(base), len(base), None, None)]
    for label in ("async save #1 (allocates pinned buffers)", "async save #2"):
        sync()
        t0 = time.perf_counter()
        t.save()
        blocked = time.perf_counter() - t0
        during, after = [], []
        write_start = time.perf_counter()
        while len(during) + len(after) < args.steps or not t.pending_save.done():
            busy = not t.pending_save.done()
            (during if busy else after).append(timed_step(t)[0])
        write_s = time.perf_counter() - write_start  # upper bound: includes the steps after it finished
        t.wait_for_save()
        rows.append((label, statistics.mean(during) if during else float("nan"),
                     statistics.median(during) if during else float("nan"), len(during), blocked, write_s))
        print(rows[-1], flush=True)
    t.cfg = dataclasses.replace(t.cfg, ckpt=dataclasses.replace(t.cfg.ckpt, async_save=False))  # a changed copy
    sync()
    t0 = time.perf_counter()
    ckpt = t.save()
    sync_s = time.perf_counter() - t0
    size = dir_bytes(ckpt)
    saved_at = t.iteration
    cont = [timed_step(t)[1] for _ in range(3)]
    t.close()
    del t
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    r = Trainer(parse_args(flags + ["--load", str(save_dir)]))
    load_s = time.perf_counter() - t0
    assert r.iteration == saved_at, (r.iteration, saved_at)
    resumed = [timed_step(r)[1] for _ in range(3)]
    r.close()
    if args.save_dir is None:
        shutil.rmtree(save_dir, ignore_errors=True)

    base_mean = rows[0][1]
    lines = ["| case | steps timed | mean step ms | median step ms | vs no save | save() blocked ms | write s (bound) |",
             "|---|---|---|---|---|---|---|"]
    for label, mean, med, n, blocked, write_s in rows:
        lines.append(f"| {label} | {n} | {mean * 1e3:.1f} | {med * 1e3:.1f} | {mean / base_mean:.3f}x | "
                     f"{'' if blocked is None else f'{blocked * 1e3:.0f}'} | {'' if write_s is None else f'{write_s:.1f}'} |")
    table = "\n".join(lines)
    extra = (f"- checkpoint size: {size / 2**30:.2f} GiB ({ckpt.name}); synchronous save: {sync_s:.1f} s "
             f"({size / 2**30 / sync_s:.2f} GiB/s); load + verify in a fresh trainer: {load_s:.1f} s\n"
             f"- losses of the 3 steps after iteration {saved_at}: original {[round(x, 5) for x in cont]}, "
             f"resumed {[round(x, 5) for x in resumed]}, max |diff| {max(abs(a - b) for a, b in zip(cont, resumed)):.2e}\n")
    print("\n" + table + "\n" + extra)
    write_record(args.record_dir, f"checkpoint_overhead_{args.config}", f"Checkpoint overhead: {args.config}", device,
                 {"method": f"{args.warmup} warm-up steps, then each step CUDA-synchronised and timed alone; see the "
                            "script's docstring"}, f"{table}\n\n{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loss curves and throughput of the same training run in several parallel layouts, through the
real command line (`torchrun pretrain_gpt.py ...`), side by side.

    python benchmarks/parallel_curves.py --base "--config gpt-350m --train-iters 50" \
        --run "tp1:1:" --run "tp2-sp:2:--tensor-model-parallel-size 2 --sequence-parallel"

Each --run is NAME:PROCESSES:FLAGS. Every run logs each iteration; the table gives each run's loss per
logged step, the largest relative difference from the first run, and tokens/s (all GPUs together,
mean over the logged steps after the first 5). Writes a Markdown record to --record-dir (default:
$OUT if set, else benchmarks/results).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402  (benchmarks/record.py)


def parse(stdout: str) -> tuple[dict[int, float], dict[int, float]]:
    losses, tps = {}, {}
    for line in stdout.splitlines():
        m = re.search(r"iteration\s+(\d+)/", line)
        lm = re.search(r"lm loss: ([0-9.E+-]+) \|", line)
        tm = re.search(r"tokens per second per GPU: ([0-9.]+)", line)
        if m and lm:
            losses[int(m.group(1))] = float(lm.group(1))
            if tm:
                tps[int(m.group(1))] = float(tm.group(1))
    return losses, tps


def run(name: str, nproc: int, flags: str, base: str, timeout: int) -> dict:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["pretrain_gpt.py", *shlex.split(base), "--log-interval", "1", "--eval-iters", "0", *shlex.split(flags)]
    start = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    losses, tps = parse(r.stdout)
    steady = [v for k, v in sorted(tps.items()) if k > 5]
    return {"name": name, "nproc": nproc, "flags": flags, "rc": r.returncode, "losses": losses,
            "tokens_s": (sum(steady) / len(steady) * nproc) if steady else None, "wall_s": time.time() - start,
            "cmd": " ".join(cmd), "tail": (r.stdout + r.stderr)[-1500:] if r.returncode else ""}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="flags common to every run")
    p.add_argument("--run", action="append", required=True, help="NAME:PROCESSES:FLAGS")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--tag", default="parallel_curves")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    results = []
    for spec in args.run:
        name, nproc, flags = spec.split(":", 2)
        r = run(name, int(nproc), flags, args.base, args.timeout)
        print(f"{name}: rc {r['rc']}, {len(r['losses'])} logged steps, tokens/s {r['tokens_s']}, "
              f"{r['wall_s']:.0f} s", flush=True)
        if r["rc"]:
            print(r["tail"], flush=True)
        results.append(r)
    ref = results[0]["losses"]
    lines = ["| run | processes | flags | tokens/s (all GPUs) | max rel. loss diff vs first | final loss |",
             "|---|---|---|---|---|---|"]
    for r in results:
        common = [k for k in ref if k in r["losses"]]
        diff = max((abs(r["losses"][k] - ref[k]) / abs(ref[k]) for k in common), default=float("nan"))
        final = r["losses"][max(r["losses"])] if r["losses"] else None
        tok = f"{r['tokens_s']:.0f}" if r["tokens_s"] else "-"
        lines.append(f"| {r['name']} | {r['nproc']} | `{r['flags']}` | {tok} | {diff:.2e} | {final} |")
    steps = sorted(ref)
    curve = ["| step | " + " | ".join(r["name"] for r in results) + " |", "|---" * (len(results) + 1) + "|"]
    for k in steps:
        curve.append(f"| {k} | " + " | ".join(f"{r['losses'].get(k, float('nan')):.4f}" for r in results) + " |")
    table, curves = "\n".join(lines), "\n".join(curve)
    print("\n" + table + "\n\n" + curves)
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_record(args.record_dir, args.tag, args.tag,
                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} x {device}",
                 {"base flags": f"`{args.base}`", "commands": "; ".join(f"`{r['cmd']}`" for r in results)},
                 table + "\n\nLoss per step:\n\n" + curves)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

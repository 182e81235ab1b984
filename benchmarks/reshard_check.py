"""Sharded checkpoints across layouts on GPUs (NCCL for training, the gloo checkpoint group for the
save/load plans): a run at TP=N stopped by --exit-interval resumes at DP=N with the distributed
optimizer and at PP=N; their losses are compared with the uninterrupted TP=N run.

    python benchmarks/reshard_check.py --gpus 2

fp32, a small GPT (so the layouts agree to rounding); RESHARD_DEVICE=cpu runs it on CPU processes
(gloo) instead. Writes a Markdown record to --record-dir
(default: $OUT if set, else benchmarks/results).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import write_record  # noqa: E402  (benchmarks/record.py)

LOSS = re.compile(r"lm loss: ([0-9.E+-]+) \|")
ITERS, STOP = 8, 4
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
         "--max-position-embeddings", "512", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--train-iters", str(ITERS), "--lr", "1e-3", "--lr-warmup-iters", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0", "--device", os.environ.get("RESHARD_DEVICE", "cuda")]


def run(gpus: int, flags: list[str]) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
           "pretrain_gpt.py", *MODEL, *flags]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(flags)} exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    return [float(x) for x in LOSS.findall(r.stdout)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    n = str(args.gpus)
    ck = Path(tempfile.mkdtemp(prefix="reshard_"))
    ref = run(args.gpus, ["--tensor-model-parallel-size", n])
    first = run(args.gpus, ["--tensor-model-parallel-size", n, "--exit-interval", str(STOP), "--save", str(ck / "a"),
                            "--async-save"])
    rows = [("TP" + n + " uninterrupted", ref), (f"TP{n}, stopped at {STOP} (async save)", first)]
    for name, layout in ((f"DP{n} + distributed optimizer", ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                                               "--overlap-param-gather"]),
                         (f"PP{n}", ["--pipeline-model-parallel-size", n])):
        d = ck / name.split()[0]
        subprocess.run(["cp", "-r", str(ck / "a"), str(d)], check=True)
        rows.append((f"{name}, resumed from it", [float("nan")] * STOP + run(args.gpus, layout + ["--load", str(d)])))
    worst = max(abs(a - b) / abs(a) for _, losses in rows[1:] for a, b in zip(ref, losses) if b == b)
    header = "| run | " + " | ".join(f"it {i + 1}" for i in range(ITERS)) + " |"
    lines = [header, "|---" * (ITERS + 1) + "|"]
    for name, losses in rows:
        lines.append(f"| {name} | " + " | ".join("" if x != x else f"{x:.6f}" for x in losses) + " |")
    table = "\n".join(lines) + f"\n\nlargest relative difference from the uninterrupted run: {worst:.2e}\n"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(table)
    write_record(args.record_dir, f"reshard_check_{args.gpus}gpu", f"Resharded resume on {args.gpus} GPUs",
                 f"{args.gpus} x {device}", {"model flags": f"`{' '.join(MODEL)}`"}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

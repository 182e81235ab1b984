"""How right ``paratron plan`` is on one GPU: for each configuration (recompute, micro-batch, sequence length,
FP8, MoE, the distributed optimizer), the predicted peak of allocated memory and step time beside
torch.cuda.max_memory_allocated and the measured time of the Trainer's steps (after warm-up). Writes a record.

    python benchmarks/plan_accuracy.py [--steps 6] [--only NAME ...] [--efficiency 0.5]

Acceptance (issue 43): memory within 10 %, step time within 20 %."""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.record import ROOT, write_record  # noqa: E402
from paratron.plan.cost import Cluster, step_time  # noqa: E402
from paratron.plan.layout import layout_of  # noqa: E402
from paratron.plan.memory import rank_memory  # noqa: E402
from paratron.plan.search import dp_bytes  # noqa: E402
from paratron.train.loop import Trainer  # noqa: E402
from paratron.train.resolve import parse_args  # noqa: E402

BASE = "--train-iters 100 --eval-iters 0 --log-interval 1000"
CONFIGS = {  # name: flags over BASE (bf16 presets)
    "llama-1b mb4": "--config llama-1b --micro-batch-size 4 --global-batch-size 8",
    "llama-1b mb1": "--config llama-1b --micro-batch-size 1 --global-batch-size 4",
    "llama-1b mb8 selective": "--config llama-1b --micro-batch-size 8 --global-batch-size 8 "
                              "--recompute-granularity selective",
    "llama-1b mb8 full": "--config llama-1b --micro-batch-size 8 --global-batch-size 8 --recompute-granularity full "
                         "--recompute-method uniform --recompute-num-layers 1",
    "llama-1b seq4096": "--config llama-1b --micro-batch-size 2 --global-batch-size 4 --seq-length 4096 "
                        "--max-position-embeddings 4096",
    "llama-1b seq8192 full": "--config llama-1b --micro-batch-size 1 --global-batch-size 2 --seq-length 8192 "
                             "--max-position-embeddings 8192 --recompute-granularity full --recompute-method uniform "
                             "--recompute-num-layers 2",
    "llama-1b fp8": "--config llama-1b --micro-batch-size 4 --global-batch-size 8 --fp8-format hybrid",
    "llama-1b distopt": "--config llama-1b --micro-batch-size 4 --global-batch-size 8 --use-distributed-optimizer",
    "gpt-350m mb8": "--config gpt-350m --micro-batch-size 8 --global-batch-size 16 --bf16",
    "moe-mini mb2": "--config moe-mini --micro-batch-size 2 --global-batch-size 4",
    "moe-mini mb4 selective": "--config moe-mini --micro-batch-size 4 --global-batch-size 4 "
                              "--recompute-granularity selective",
}


def measure(flags: str, steps: int, cluster: Cluster) -> dict:
    cfg = parse_args((BASE + " " + flags).split(), world_size=1)
    layout = layout_of(cfg)
    mem = rank_memory(cfg.model, cfg.padded_vocab_size, layout, 0, cfg.parallel)
    pred_t = step_time(cfg.model, cfg.padded_vocab_size, layout, cluster,
                       *dp_bytes(cfg.model, cfg.padded_vocab_size, layout, {})).total
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    try:
        trainer.train_step()  # warm-up (compilation, allocator)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / steps
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
    finally:
        trainer.close()
        del trainer
    return {"pred_mem": mem.peak, "mem": peak, "reserved": reserved, "pred_s": pred_t, "s": seconds}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--efficiency", type=float, default=0.5, help="the plan's --matmul-efficiency")
    ap.add_argument("--record-dir", default=None)
    args = ap.parse_args()
    cluster = Cluster(1, 1, args.gpu, matmul_efficiency=args.efficiency)
    rows = ["| config | predicted GiB | max allocated GiB | error | reserved GiB | predicted s | measured s | error |",
            "|---|---|---|---|---|---|---|---|"]
    for name, flags in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        try:
            r = measure(flags, args.steps, cluster)
        except torch.cuda.OutOfMemoryError:
            rows.append(f"| {name} | | out of memory | | | | | |")
            continue
        g = 2 ** 30
        rows.append(f"| {name} | {r['pred_mem'] / g:.2f} | {r['mem'] / g:.2f} | {r['pred_mem'] / r['mem'] - 1:+.1%} | "
                    f"{r['reserved'] / g:.2f} | {r['pred_s']:.3f} | {r['s']:.3f} | {r['pred_s'] / r['s'] - 1:+.1%} |")
        print(rows[-1], flush=True)
    import os
    out = args.record_dir or os.environ.get("OUT") or ROOT / "benchmarks" / "results"
    write_record(out, "plan_accuracy", "paratron plan: predicted against measured, one GPU",
                 torch.cuda.get_device_name(), {"matmul efficiency": f"{args.efficiency}"}, "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

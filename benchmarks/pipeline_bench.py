"""Pipeline-parallel training throughput and measured pipeline idle time, through the real trainer.

    torchrun --nproc-per-node 2 benchmarks/pipeline_bench.py --config gpt-350m --pp 2 --steps 50
    torchrun --nproc-per-node 2 benchmarks/pipeline_bench.py --pp 2 --vpp 2        # interleaved
    python benchmarks/pipeline_bench.py --pp 1                                      # one-GPU baseline
    ... -- --torch-compile                                       # extra Megatron/paratron flags after --

Each step is Trainer.train_step (mock data through the real data path, the 1F1B or interleaved
schedule, gradient buffer, AdamW). Timing: ``--warmup`` steps, then every step between CUDA
synchronisations. Idle: this script gives the schedule a P2P subclass (``TimedP2P``, the schedule's
``p2p_class``) that times each pipeline transfer: on GPUs with CUDA events on the compute stream (an
event before the batched send/receive is posted, one after the stream waits for it), on CPU/gloo
with the host clock around the blocking exchange. So it is the time each stage sat waiting for its
neighbours (the bubble plus transfer time); idle fraction = that time / step time, per stage. The
schedule itself has no timing code. Rank 0 prints a table and writes a Markdown record (date,
hardware, torch, commit, command, figures) to --record-dir (default $OUT if set, else
benchmarks/results).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import write_record  # noqa: E402  (benchmarks/record.py)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class IdleClock:
    """Time spent in pipeline transfers: CUDA event pairs, or host seconds on CPU."""

    def __init__(self):
        self.events, self.host = [], 0.0

    def take(self) -> float:
        """Seconds waited since the last call (synchronises the GPU)."""
        if self.events:
            torch.cuda.synchronize()
        total = self.host + sum(a.elapsed_time(b) for a, b in self.events) / 1000.0
        self.events, self.host = [], 0.0
        return total


CLOCK = IdleClock()


def timed_p2p_class():
    from paratron.parallel.p2p import P2P

    class TimedP2P(P2P):
        """P2P whose exchanges are timed into CLOCK."""

        def exchange(self, *args, **kwargs):
            if self.device.type == "cuda":  # GPU time the compute stream waits for the transfer
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = super().exchange(*args, **kwargs)
                end.record()
                CLOCK.events.append((start, end))
                return out
            start = time.perf_counter()  # gloo: the exchange blocks the host until it is done
            out = super().exchange(*args, **kwargs)
            CLOCK.host += time.perf_counter() - start
            return out
    return TimedP2P


def parse() -> tuple[argparse.Namespace, list]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt-350m", help="preset or YAML file")
    p.add_argument("--pp", type=int, default=2, help="--pipeline-model-parallel-size")
    p.add_argument("--vpp", type=int, default=None, help="--virtual-pipeline-model-parallel-size")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=64, help="micro-batches per step = this / (mbs x DP)")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra training flags")
    args = p.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    flags = ["--config", args.config, "--pipeline-model-parallel-size", str(args.pp),
             "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
             "--train-iters", str(args.warmup + args.steps + 1), "--eval-iters", "0", "--log-interval", "1000000",
             "--mock-data", *extra]
    if args.vpp:
        flags += ["--virtual-pipeline-model-parallel-size", str(args.vpp)]
    return args, flags


def measure(trainer, args) -> dict:
    """This rank's mean step and idle time over the timed steps, peak memory, last loss."""
    from paratron.parallel.pipeline import PipelineSchedule
    d = trainer.dims
    if isinstance(trainer.forward_backward, PipelineSchedule):  # before the first step: transfers are made then
        trainer.forward_backward.p2p_class = timed_p2p_class()
    for _ in range(args.warmup):
        trainer.train_step()
    sync()
    CLOCK.take()  # drop the warm-up's
    step_s, idle_s, losses = [], [], []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        report, _, _ = trainer.train_step()
        sync()
        step_s.append(time.perf_counter() - start)
        idle_s.append(CLOCK.take())
        losses.append(report.tolist())
    return {"rank": d.rank, "pp_rank": d.pp_rank, "tp_rank": d.tp_rank, "dp_rank": d.dp_rank,
            "step_s": sum(step_s) / len(step_s), "idle_s": sum(idle_s) / len(idle_s),
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "loss": (losses[-1][0] / max(losses[-1][1], 1.0)) if d.is_last_stage else None}


def report(everyone: list, cfg, d, args, flags: list) -> None:
    """Rank 0: the summary and per-rank table, printed and written as a record."""
    step = max(r["step_s"] for r in everyone)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    m = args.global_batch_size // (args.micro_batch_size * d.dp)
    v = d.vpp or 1
    bubble = (d.pp - 1) / (v * m + d.pp - 1) if d.pp > 1 else 0.0
    loss = next(r["loss"] for r in everyone if r["loss"] is not None)
    rows = ["| rank | stage | step ms | idle ms | idle fraction | peak GiB |", "|---|---|---|---|---|---|"]
    for r in sorted(everyone, key=lambda r: r["rank"]):
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        rows.append(f"| {r['rank']} | {r['pp_rank']} | {r['step_s'] * 1e3:.1f} | {r['idle_s'] * 1e3:.1f} | "
                    f"{r['idle_s'] / r['step_s']:.3f} | {peak} |")
    idle = sum(r["idle_s"] / r["step_s"] for r in everyone) / len(everyone)
    summary = (f"{d.describe()}, virtual stages {v}, {m} micro-batches of {args.micro_batch_size} x "
               f"{cfg.model.seq_length} tokens per step: {tokens / step:.0f} tokens/s (all GPUs), "
               f"{step * 1e3:.1f} ms/step, mean idle fraction {idle:.3f} (schedule's bubble (P-1)/(V m+P-1) = "
               f"{bubble:.3f}), final loss {loss:.4f}")
    table = "\n".join(rows)
    print(summary + "\n\n" + table, flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_record(args.record_dir, f"pipeline_bench_{args.config}_pp{d.pp}", f"Pipeline throughput and idle: {args.config}",
                 f"{d.world_size} x {device}",
                 {"flags": f"`{' '.join(flags)}`",
                  "method": f"{args.warmup} warm-up + {args.steps} timed steps, each between CUDA synchronisations; "
                            "idle = time waiting on pipeline transfers (CUDA events on the compute stream; "
                            "host clock on CPU)"},
                 f"{summary}\n\n{table}")


def main() -> int:
    args, flags = parse()
    from paratron.config import parse_args
    from paratron.train.loop import Trainer
    cfg = parse_args(flags)
    trainer = Trainer(cfg)
    d = trainer.dims
    mine = measure(trainer, args)
    everyone = [None] * d.world_size
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    trainer.close()
    if d.rank == 0:
        report(everyone, cfg, d, args, flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())

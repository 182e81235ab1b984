#!/usr/bin/env python
"""Optimizer-state memory per rank: the plain optimizer at DP=1 against the distributed optimizer
(ZeRO-1) at DP=N, on CPU/gloo with a small GPT, fp32 and bf16.

"Optimizer state" is what the optimizer holds beyond the model: Adam's two moments and the fp32
master copies that are not the model's own parameters (bf16). One real training step is taken so
that Adam has created its state; the figure is ``optimizer.state_bytes()``.

    python benchmarks/optimizer_memory.py [--dp 4]

prints one line per precision and exits non-zero if a ratio is above 30 %.

On GPUs, fitting bigger models on the real training step (Trainer.train_step under torchrun):

    python benchmarks/optimizer_memory.py offload [--gpus 1] [--shape "..."] [--offload "..."] [--steps 10]
    python benchmarks/optimizer_memory.py fp8-gather --gpus 2 [--shape "..."] [--steps 100]
    python benchmarks/optimizer_memory.py strategies --gpus 8 [--shape "..."] [--steps 20]
    python benchmarks/optimizer_memory.py variants --gpus 1 --shape "..." --variant "FLAGS" [--variant "FLAGS" ...]

offload: the shape without offload (expected: CUDA out of memory, recorded as such with the peak it reached)
and with ``--offload`` flags (default ``--optimizer-cpu-offload --optimizer-offload-fraction 0.5``): tokens/s,
peak memory, bytes per rank of parameters / gradients / optimizer state (device and host).
fp8-gather: FP8 training under ZeRO-3 with and without ``--fp8-param-gather`` for ``--steps`` steps (needs 2+
ranks: on one there is no all-gather; ``--ranks-per-gpu 2`` runs two ranks on each GPU over gloo, which moves the
collectives through the host: the numerics of the FP8 gather without NCCL's speed); the verdict compares the two loss curves (largest relative difference
of the mean loss over windows of 10 steps, limit 1 %).
strategies: tokens/s and peak memory per GPU of each ``--data-parallel-sharding-strategy``.
variants: the shape alone and with each ``--variant``'s flags added (activation offloading, lower-precision Adam
moments, ...): tokens/s, peak memory and the bytes per rank of each.
Each run is `torchrun --standalone --nproc-per-node G` of this file in worker mode; a Markdown record (date,
hardware, torch, commit, commands, table) goes to --record-dir (default: $OUT if set, else benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from record import write_record  # noqa: E402  (benchmarks/record.py)
from paratron.config import Config, finalize  # noqa: E402
from paratron.parallel.dims import shutdown_distributed  # noqa: E402

LIMIT = 0.30
GPU_MODES = ("offload", "fp8-gather", "strategies", "variants", "worker")


def small_config(precision: str, distributed: bool, dp: int) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 128, 4, 16
    m.hidden_dropout = m.attention_dropout = 0.0
    m.make_vocab_size_divisible_by = 64
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.train_iters = 1, dp, 1
    cfg.train.bf16 = precision == "bf16"
    cfg.parallel.use_distributed_optimizer = distributed
    cfg.optim.lr = 1e-3
    cfg.data.mock_data, cfg.data.vocab_size = True, 512
    return finalize(cfg)


def measure(precision: str, distributed: bool) -> dict:
    """One step on this process's layout (torch.distributed initialised or a single process)."""
    from paratron.train.loop import Trainer, build_dims
    dp = dist.get_world_size() if dist.is_initialized() else 1
    cfg = small_config(precision, distributed, dp)
    dims = build_dims(cfg)
    s = cfg.model.seq_length
    g = torch.Generator().manual_seed(dims.dp_rank)
    toks = torch.randint(0, 512, (1, s + 1), generator=g)
    batch = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": torch.ones(1, s),
             "position_ids": torch.arange(s)[None]}
    trainer = Trainer(cfg, device=torch.device("cpu"), dims=dims, data=(iter([batch]), None))
    trainer.train_step()
    out = {"state_bytes": trainer.optimizer.state_bytes(), "params": trainer.model.module.num_parameters()}
    trainer.close()
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {p: measure(p, True) for p in ("fp32", "bf16")}
    if rank == 0:
        queue.put(result)
    shutdown_distributed()


def run_distributed(dp: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_worker, args=(dp, port, queue), nprocs=dp, join=True, start_method="spawn")
    return queue.get()


def report(single: dict, sharded: dict, dp: int) -> list[tuple[str, float]]:
    ratios = []
    for p in ("fp32", "bf16"):
        a, b = single[p]["state_bytes"], sharded[p]["state_bytes"]
        ratio = b / a
        ratios.append((p, ratio))
        print(f"optimizer state per rank, {p}, {single[p]['params'] / 1e6:.2f}M parameters: DP=1 plain "
              f"{a / 2**20:.2f} MiB, DP={dp} distributed {b / 2**20:.2f} MiB, ratio {100 * ratio:.1f} % "
              f"(limit {100 * LIMIT:.0f} %)")
    return ratios


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in GPU_MODES:
        return fit_main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=4)
    args = ap.parse_args()
    single = {p: measure(p, False) for p in ("fp32", "bf16")}
    sharded = run_distributed(args.dp)
    return 0 if all(r <= LIMIT for _, r in report(single, sharded, args.dp)) else 1


# Llama-3-8B's width with 36 layers instead of 32: 8.9 B parameters; bf16 weights + fp32 gradients + fp32
# masters and Adam moments are 18 bytes a parameter (160 GB: more than an H200's 141 GB) without offload, 12
# (107 GB) with half the optimizer offloaded. (Llama-3-8B itself, 144 GB, still fit an H200 without offload:
# benchmarks/results/optimizer_memory_offload_1gpu_20261202_160730.md.)
SHAPE_9B = ("--num-layers 36 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
            "--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type "
            "rope --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256 --seq-length 2048 "
            "--max-position-embeddings 2048 --micro-batch-size 1 --bf16 --recompute-granularity full "
            "--recompute-method uniform --recompute-num-layers 1 --mock-data --tokenizer-type NullTokenizer --lr 1e-4")
SMALL = "--config llama-1b --bf16 --micro-batch-size 4 --mock-data --lr 3e-4"
# real English text (the standard library's docstrings, prepared where the benchmark runs): a 125M GPT does not
# memorise it within 100 steps as it does mock data, whose losses fall to 0.1 and make relative gaps meaningless
TEXT = ("--config gpt-125m --bf16 --micro-batch-size 2 --seq-length 1024 --max-position-embeddings 1024 "
        "--data-path {GPT_DATA} --vocab-file {VOCAB} --tokenizer-type BertWordPieceLowerCase --split 100,0,0 "
        "--lr 3e-4 --num-workers 0")
FP8 = "--fp8-format hybrid --fp8-recipe tensorwise"
ZERO3 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def worker(args) -> None:
    """One rank of a run (under torchrun): ``--steps`` steps, the losses, speed and memory as JSON."""
    import torch
    from paratron.optim.memory import per_rank_state_bytes
    from paratron.parallel.dims import shutdown_distributed
    from paratron.train.loop import Trainer
    from paratron.train.resolve import parse_args  # (the tokenizer's vocabulary size read from its files)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ranks_per_gpu > 1:  # several ranks on one GPU: NCCL refuses that, gloo takes CUDA tensors
        os.environ["LOCAL_RANK"] = str(int(os.environ["LOCAL_RANK"]) // args.ranks_per_gpu)
    flags = [*shlex.split(args.flags), "--train-iters", str(args.steps + 1), "--eval-iters", "0",
             "--log-interval", "1000000"]
    # The micro-batch as given (parsing the flags alone would check it against the default global batch)
    mbs = (int(flags[flags.index("--micro-batch-size") + 1]) if "--micro-batch-size" in flags
           else parse_args(flags, world_size=1).train.micro_batch_size)
    cfg = parse_args(flags + ["--global-batch-size", str(mbs * args.micro_batches * world)])
    out: dict = {"gpus": world // args.ranks_per_gpu, "ranks": world, "losses": []}
    try:
        trainer = Trainer(cfg)
        start = None
        for i in range(args.steps):
            if i == min(2, args.steps - 1):
                torch.cuda.synchronize()
                start, timed = time.perf_counter(), args.steps - i
            report, _, _ = trainer.train_step()
            out["losses"].append(float(report[0] / report[1]) if report[1] > 0 else None)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - start) / timed
        out.update(step_ms=round(dt * 1e3, 1), tok_s=round(cfg.train.global_batch_size * cfg.model.seq_length / dt),
                   bytes={k: round(v / 2**30, 2) for k, v in per_rank_state_bytes(trainer.models,
                                                                                  trainer.optimizer).items()})
        trainer.close()
    except torch.cuda.OutOfMemoryError as e:
        out["oom"] = " ".join(str(e).split())[:200]
    out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(out))
    shutdown_distributed()


def run_gpus(gpus: int, flags: str, args) -> tuple[dict, str]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(gpus * args.ranks_per_gpu),
               str(Path(__file__).resolve()), "worker", "--result", str(result), "--steps", str(args.steps),
               "--micro-batches", str(args.micro_batches), "--ranks-per-gpu", str(args.ranks_per_gpu), "--flags",
               flags + (" --distributed-backend gloo" if args.ranks_per_gpu > 1 else "")]
        print("$ " + shlex.join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT)
        if not result.is_file():
            return {"gpus": gpus, "error": f"exit {proc.returncode}"}, shlex.join(cmd)
        return json.loads(result.read_text()), shlex.join(cmd)


def row(label: str, r: dict) -> str:
    b = r.get("bytes", {})
    state = " / ".join(str(b.get(k)) for k in ("params", "grads", "optimizer", "optimizer_host")) if b else "-"
    what = r.get("oom") and f"out of memory: {r['oom']}" or r.get("error") or "trained"
    return f"| {label} | {r.get('gpus')} ({r.get('ranks')}) | {r.get('tok_s', '-')} | {r.get('step_ms', '-')} | {r.get('peak_gb')} | " \
           f"{state} | {what} |"


def windows(losses: list, n: int = 10) -> list:
    vals = [x for x in losses if x is not None]
    return [sum(vals[i: i + n]) / len(vals[i: i + n]) for i in range(0, len(vals), n)]


def fit_main() -> int:
    """The GPU modes (offload, fp8-gather, strategies) and ``worker``, one rank of their runs."""
    p = argparse.ArgumentParser(description="Fitting bigger models on GPUs (the module doc)")
    p.add_argument("mode", choices=GPU_MODES)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--shape", default=None, help="model, batch and precision flags (default: per mode)")
    p.add_argument("--offload", default="--optimizer-cpu-offload --optimizer-offload-fraction 0.5")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--variant", action="append", default=[], help="variants: flags added to the shape (repeat)")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--ranks-per-gpu", type=int, default=1, help="ranks on each GPU (> 1: gloo, not NCCL)")
    p.add_argument("--record-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--flags", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode == "worker":
        worker(args)
        return 0
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    args.steps = args.steps or {"offload": 10, "fp8-gather": 100, "strategies": 20, "variants": 10}[args.mode]
    shape = args.shape or {"offload": SHAPE_9B, "fp8-gather": TEXT}.get(args.mode, SMALL)
    if "{GPT_DATA}" in shape:
        from paratron.data.corpus import prepare_docstring_data
        data = prepare_docstring_data(tempfile.mkdtemp(prefix="docstrings_"))
        shape = shape.replace("{GPT_DATA}", data["gpt"]).replace("{VOCAB}", data["vocab"])
    if args.mode == "offload":
        runs = {"no offload": shape, "offload": f"{shape} {args.offload}"}
    elif args.mode == "fp8-gather":
        runs = {"bf16 gather": f"{shape} {FP8} {ZERO3}", "fp8 gather": f"{shape} {FP8} {ZERO3} --fp8-param-gather"}
    elif args.mode == "variants":
        runs = {"shape alone": shape, **{f"`{v}`": f"{shape} {v}" for v in args.variant}}
    else:
        runs = {s: f"{shape} --use-megatron-fsdp --data-parallel-sharding-strategy {s}" for s in STRATEGIES}
    results = {label: run_gpus(args.gpus, flags, args) for label, flags in runs.items()}
    rows = ["| run | GPUs (ranks) | tokens/s | step ms | peak GiB | GiB/rank params / grads / optimizer / host | result |",
            "|---|---|---|---|---|---|---|"] + [row(label, r) for label, (r, _) in results.items()]
    ok, verdict = True, ""
    if args.mode == "offload":
        a, b = results["no offload"][0], results["offload"][0]
        ok = "oom" in a and "tok_s" in b
        verdict = f"no offload: {'out of memory' if 'oom' in a else 'trained'}; offload: " \
                  f"{'trained' if 'tok_s' in b else 'failed'} ({'as intended' if ok else 'NOT the intended outcome'})"
    elif args.mode == "fp8-gather":
        a, b = (windows(results[k][0].get("losses", [])) for k in ("bf16 gather", "fp8 gather"))
        diff = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=None)
        ok = diff is not None and len(a) == len(b) and diff <= 0.01
        verdict = (f"largest relative difference of 10-step mean losses: {diff} "
                   f"(limit 0.01: {'met' if ok else 'NOT met'})")
    table = "\n".join(rows)
    print("\n" + table + "\n\n" + verdict)
    facts = {"runs": "; ".join(f"`{c}`" for _, c in results.values()),
             "method": f"{args.steps} steps; tokens/s over the steps after the first 2"}
    write_record(args.record_dir, f"optimizer_memory_{args.mode}_{args.gpus}gpu", f"Fitting bigger models: {args.mode}",
                 f"{args.gpus} x {device}", facts,
                 f"{table}\n\n{verdict}\n\nlosses: {json.dumps({k: r.get('losses') for k, (r, _) in results.items()})}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

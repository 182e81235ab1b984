#!/usr/bin/env python
"""Optimizer-state memory per rank: the plain optimizer at DP=1 against the distributed optimizer
(ZeRO-1) at DP=N, on CPU/gloo with a small GPT, fp32 and bf16.

"Optimizer state" is what the optimizer holds beyond the model: Adam's two moments and the fp32
master copies that are not the model's own parameters (bf16). One real training step is taken so
that Adam has created its state; the figure is ``optimizer.state_bytes()``.

    python benchmarks/optimizer_memory.py [--dp 4]

prints one line per precision and exits non-zero if a ratio is above 30 %.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paratron.config import Config, finalize  # noqa: E402
from paratron.parallel.dims import shutdown_distributed  # noqa: E402

LIMIT = 0.30


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=4)
    args = ap.parse_args()
    single = {p: measure(p, False) for p in ("fp32", "bf16")}
    sharded = run_distributed(args.dp)
    return 0 if all(r <= LIMIT for _, r in report(single, sharded, args.dp)) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Megatron's run watchers: ``--profile-ranks`` (which ranks ``--profile`` traces), ``--log-progress``
(a progress.txt of the job beside the checkpoints) and ``--check-weight-hash-across-dp-replicas-interval``
(every data-parallel replica holds the same weights: a silent divergence, from a bad GPU or a bug, stops
the run at once).

progress.txt lines are Megatron's: ``<time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world>\\t<event>``, the
events ``Starting job`` and ``Saved checkpoint`` (with the iteration, this job's TFLOP/s per GPU, the
floating-point operations and tokens of the run so far). Megatron's cumulative throughput over earlier
jobs is not there (paratron does not keep their training time).

The weight check fingerprints each parameter on the device (its bytes as 32-bit words, summed with
position-dependent odd weights in wrapping 64-bit arithmetic: any changed bit changes it), gathers the
fingerprints over the group each parameter is replicated on (``dp_cp`` for dense weights, ``edp`` for
experts) and raises naming the first parameter that differs and the ranks.
"""
from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..parallel.sharding import spec_of


def profiled(log, rank: int) -> bool:
    """Whether ``--profile`` traces global rank ``rank`` (``--profile-ranks``; default every rank)."""
    return log.profile_ranks is None or rank in log.profile_ranks


class ProgressLog:
    """``--log-progress``: appends to ``<save>/progress.txt`` on global rank 0 (nothing elsewhere)."""

    def __init__(self, cfg, rank: int, world: int, flops_per_iteration: float, start_iteration: int):
        self.path: Optional[Path] = Path(cfg.ckpt.save) / "progress.txt" if cfg.log.log_progress and rank == 0 else None
        self.world, self.flops = world, flops_per_iteration
        self.start_time, self.start_iteration = time.time(), start_iteration
        self.seq = cfg.model.seq_length
        self.write("Starting job")

    def write(self, event: str) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                    f"# GPUs: {self.world}\t{event}\n")

    def saved(self, iteration: int, consumed_samples: int) -> None:
        seconds = max(time.time() - self.start_time, 1e-9)
        job = (iteration - self.start_iteration) * self.flops / seconds / self.world / 1e12
        self.write(f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job:.2f} TFLOP/s/GPU\t"
                   f"Floating-point operations: {iteration * self.flops:.2e}\t"
                   f"Tokens (in billions): {consumed_samples * self.seq / 1e9:.2f}")


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """A 64-bit fingerprint of ``p``'s bytes (0-d int64 on its device)."""
    raw = p.detach().contiguous().view(-1).view(torch.uint8)
    raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 4)]).view(torch.int32).to(torch.int64)
    odd = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) * 2654435762 + 1  # a distinct odd weight each
    return (raw * odd).sum()


def check_weight_hashes(models: list, dims, iteration: int) -> None:
    """Raise RuntimeError when a parameter differs between the replicas that should hold it equally."""
    by_group: dict = {}
    for m in models:
        m.finish_param_sync()  # the distributed optimizer's gathers still in flight
        for name, p in m.module.named_parameters():
            by_group.setdefault(spec_of(p).grad_group, []).append((name, p))
    for group_name, params in by_group.items():
        group = dims.group(group_name)
        size = dims.size(group_name)
        if size == 1 or group is None:
            continue
        mine = torch.stack([_fingerprint(p) for _, p in params])
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=group)
        for r, theirs in enumerate(every):
            differ = (theirs != mine).nonzero()
            if differ.numel():
                name = params[int(differ[0])][0]
                ranks = dims.group_ranks[group_name]
                raise RuntimeError(f"iteration {iteration}: parameter {name} differs between data-parallel replicas "
                                   f"(global ranks {dims.rank} and {ranks[r]}, group {group_name}); the replicas "
                                   "have diverged: check the GPUs of these ranks")

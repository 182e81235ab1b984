"""Start-up checks of the directories a run writes to, before the model is built: ``--save``, the
``--data-cache-path`` and the ``--tensorboard-dir`` (on the rank that writes it) are created, a
probe file is written and removed, and a directory that cannot take files is one line naming the
flag, the path and the reason. An unusable ``--save`` is thus found at start-up, not at the first
save ``--save-interval`` iterations later. The free space under ``--save`` is reported beside the
estimated size of one checkpoint: an error before step 1 when it cannot hold one (unless
``--no-save-space-check``), a warning when it will not hold two (a save needs room for the new
checkpoint while the previous one is kept).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from ..config import Config
from ..errors import UserError, os_error_reason
from ..parallel.dims import ParallelDims


class StorageError(UserError):
    """A directory the run must write to cannot take files, or a save failed for lack of space."""


def probe_directory(flag: str, path: str, rank: int) -> Optional[str]:
    """Create ``path`` and write and remove a probe file in it; the problem as one line, or None."""
    probe = Path(path) / f".paratron-probe-{rank}-{os.getpid()}"
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"paratron")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        return f"{flag} {path} cannot be written to: {os_error_reason(e)}; choose a directory this user can write"
    return None


def _agree(problem: Optional[str]) -> Optional[str]:
    """The first rank's problem on every rank (no rank goes on alone into a collective)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    return problem


def checkpoint_bytes(cfg: Config) -> int:
    """About how many bytes one checkpoint of this run takes: the weights in their dtype, plus the
    fp32 master weights (bf16/fp16) and Adam's two fp32 moments unless --no-save-optim."""
    from ..model.gpt import GPTModel  # counted on the meta device: no memory, no initialisation cost
    params = sum(p.numel() for p in GPTModel(cfg.model, cfg.padded_vocab_size, device="meta").parameters())
    weight = 2 if (cfg.train.bf16 or cfg.train.fp16) else 4
    optim = 0 if cfg.ckpt.no_save_optim else 8 + (4 if weight == 2 else 0)
    return params * (weight + optim)


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 28 else f"{n / 2 ** 20:.1f} MiB"


def preflight(cfg: Config, dims: ParallelDims, say: Callable[[str], None]) -> None:
    """Check every directory this rank will write; raise StorageError on every rank if one fails.
    ``say`` prints on the logging rank (the free-space report)."""
    if not (cfg.ckpt.save or cfg.data.data_cache_path or cfg.log.tensorboard_dir):
        return  # (the same on every rank: none of them joins the gather)
    targets = [("--save", cfg.ckpt.save), ("--data-cache-path", cfg.data.data_cache_path)]
    if dims.is_logging_rank:
        targets.append(("--tensorboard-dir", cfg.log.tensorboard_dir))
    problem = next((p for flag, path in targets if path for p in [probe_directory(flag, path, dims.rank)] if p), None)
    problem = _agree(problem)
    if problem:
        raise StorageError(problem)
    problem = _agree(space_problem(cfg, say) if cfg.ckpt.save and dims.is_logging_rank else None)
    if problem:
        raise StorageError(problem)


def space_problem(cfg: Config, say: Callable[[str], None]) -> Optional[str]:
    """Report the free space under --save beside one checkpoint's size; the problem when not even one
    fits (unless --no-save-space-check), a warning when two do not."""
    need, free = checkpoint_bytes(cfg), shutil.disk_usage(cfg.ckpt.save).free
    say(f" --save {cfg.ckpt.save}: {_gib(free)} free; one checkpoint takes about {_gib(need)}")
    if free < need and not cfg.ckpt.no_save_space_check:
        return (f"--save {cfg.ckpt.save} has {_gib(free)} free but one checkpoint of this run takes about "
                f"{_gib(need)}: the first save would fail; free space, choose another --save, or pass "
                "--no-save-space-check to start anyway")
    if free < 2 * need:
        say(f" WARNING: --save {cfg.ckpt.save} has room for {free // max(need, 1)} checkpoint(s); a save "
            "keeps the previous one until the new one is complete, so it needs room for two")
    return None

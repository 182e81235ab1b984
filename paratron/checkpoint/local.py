"""Checkpoints in Megatron's directory layout: ``{save}/iter_0000100/`` plus
``{save}/latest_checkpointed_iteration.txt``.

A checkpoint is written under a temporary directory name and renamed only when every rank has
finished, and the latest marker is replaced atomically afterwards, so a crash during a save leaves
the previous checkpoint as latest. Files hold tensors and plain values only (loaded with
``weights_only=True``) plus ``metadata.json``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..parallel.dims import ParallelDims

LATEST = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names the file."""


def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def rank_file(dims: ParallelDims) -> str:
    return f"rank_{dims.rank:05d}.pt"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str | Path, iteration: int, state: dict, metadata: dict, dims: ParallelDims) -> Path:
    """Every rank writes its own ``state`` (tensors and plain values); rank 0 writes ``metadata``."""
    root = Path(root)
    final = iter_dir(root, iteration)
    tmp = root / f".{final.name}.partial"
    if dims.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    torch.save(state, tmp / rank_file(dims))
    _barrier()
    if dims.rank == 0:
        meta = dict(metadata, iteration=iteration, world_size=dims.world_size,
                    layout={"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cp": dims.cp})
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(root / LATEST, str(iteration))
    _barrier()
    return final


def latest_iteration(root: str | Path) -> Optional[int]:
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{marker} does not hold an iteration number (found {text[:40]!r})") from None


def load_checkpoint(root: str | Path, dims: ParallelDims, device: torch.device) -> Optional[tuple[dict, dict]]:
    """(this rank's state, metadata) of the latest checkpoint under ``root``, or None if there is none."""
    it = latest_iteration(root)
    if it is None:
        return None
    d = iter_dir(root, it)
    meta_path = d / "metadata.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {meta_path}: {e.__class__.__name__}") from None
    saved = meta.get("layout", {})
    if meta.get("world_size") != dims.world_size or saved.get("tp") != dims.tp or saved.get("pp") != dims.pp:
        raise CheckpointError(
            f"{d} was saved with {meta.get('world_size')} ranks (TP {saved.get('tp')}, PP {saved.get('pp')}); "
            f"this run has {dims.world_size} (TP {dims.tp}, PP {dims.pp}): resume with the same layout")
    path = d / rank_file(dims)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # truncated or corrupted file
        raise CheckpointError(f"{path} is corrupted or truncated ({e.__class__.__name__})") from None
    return state, meta

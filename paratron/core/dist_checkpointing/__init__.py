"""Megatron Core's ``dist_checkpointing.save`` / ``load`` of a ``sharded_state_dict()``, over paratron's
sharded checkpoints (paratron/checkpoint/sharded.py, torch.distributed.checkpoint underneath).

``save(sharded_state_dict, checkpoint_dir)`` writes paratron's layout under ``checkpoint_dir``
(``iter_0000000/`` and ``latest_checkpointed_iteration.txt``), every rank its own chunks of the global
tensors; ``load(sharded_state_dict, checkpoint_dir)`` returns the same (nested) dict with each
ShardedTensor replaced by a new tensor holding this rank's part, read in this rank's layout whatever
layout saved it: ``model.load_state_dict(load(model.sharded_state_dict(), path))``. Values that are not
ShardedTensors (numbers, strings, lists) go to the checkpoint's common.json and come back from it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint import sharded
from ...checkpoint.pieces import CheckpointError
from .mapping import ShardedTensor

ITERATION = 0  # the facade's checkpoints are one iteration each: the directory names the checkpoint

__all__ = ["ShardedTensor", "save", "load"]


def _leaves(tree, path=()):
    """(path, value) of every leaf of nested dicts."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, path + (k,))
    else:
        yield path, tree


def _common(tree) -> dict:
    return {"/".join(map(str, p)): v for p, v in _leaves(tree) if not isinstance(v, ShardedTensor)}


def save(sharded_state_dict: dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
         validate_access_integrity: bool = True, async_sharded_save: bool = False, **_megatron_only) -> None:
    """Every rank calls it with its own sharded state dict (Megatron's signature; the strategies are paratron's)."""
    if async_sharded_save:
        raise CheckpointError("dist_checkpointing.save(async_sharded_save=True) is not supported by paratron.core; "
                              "paratron.checkpoint.sharded.AsyncSave saves in the background")
    pieces = [pc for _, v in _leaves(sharded_state_dict) if isinstance(v, ShardedTensor) for pc in v.pieces()]
    sharded.save(Path(checkpoint_dir), ITERATION, pieces, {"facade_common": _common(sharded_state_dict)})


def load(sharded_state_dict: dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
         validate_access_integrity: bool = True, strict=None, **_megatron_only) -> dict:
    """The state dict read from ``checkpoint_dir``, in the shape of ``sharded_state_dict``."""
    d = sharded.find_checkpoint(Path(checkpoint_dir))
    if d is None:
        raise CheckpointError(f"no checkpoint under {checkpoint_dir}")
    common = sharded.read_common(d).get("facade_common", {})
    pieces = []

    def fill(tree, path=()):
        if isinstance(tree, dict):
            return {k: fill(v, path + (k,)) for k, v in tree.items()}
        if isinstance(tree, ShardedTensor):
            out = torch.empty_like(tree.data)
            pieces.extend(tree.pieces(into=out))
            return out
        return common.get("/".join(map(str, path)), tree)

    state = fill(sharded_state_dict)
    sharded.load(d, pieces)
    return state

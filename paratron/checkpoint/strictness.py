"""``--dist-ckpt-strictness``: what a load does when the checkpoint's tensors and the ones the run
asks for differ (Megatron's StrictHandling values).

"Unexpected" keys are asked for but absent from the checkpoint; "missing" keys are in the checkpoint
but not asked for (counted within the kinds of state the run loads: a --no-load-optim run does not
miss the optimizer). ``assume_ok_unexpected`` (the default) loads everything asked for, and an
absent tensor is an error naming it; ``log_*`` and ``return_*`` print the mismatches and load the
rest (an absent tensor keeps its initial value); ``raise_*`` stop before reading anything;
``ignore_all`` loads the rest without a word.
"""
from __future__ import annotations

from typing import Callable, Iterable

from ..config.values import STRICTNESS  # noqa: F401 (the --dist-ckpt-strictness modes)
from .pieces import Piece



def _kind(key: str) -> str:
    return key.split(".", 1)[0]


def mismatches(pieces: list[Piece], saved: Iterable[str]) -> tuple[list[str], list[str]]:
    """(unexpected, missing) keys of a load of ``pieces`` from a checkpoint holding ``saved``."""
    saved = set(saved)
    asked = {p.key for p in pieces}
    kinds = {_kind(k) for k in asked}
    return sorted(asked - saved), sorted(k for k in saved - asked if _kind(k) in kinds)


def apply_strictness(pieces: list[Piece], saved: Iterable[str], strictness: str,
                     warn: Callable[[str], None], group=None) -> list[Piece]:
    """The pieces to load under ``strictness``; ``raise_*`` mismatches raise CheckpointError on every
    rank of ``group`` (all of them call this)."""
    from .sharded import _raise_if_any
    if strictness == "assume_ok_unexpected":
        return pieces
    unexpected, missing = mismatches(pieces, saved)
    if not strictness.endswith("_all"):
        missing = []
    problem = None
    if unexpected or missing:
        text = (f"{len(unexpected)} tensors the run needs are not in the checkpoint ({', '.join(unexpected[:3])}"
                f"{', ...' if len(unexpected) > 3 else ''}); {len(missing)} checkpoint tensors are not used "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        if strictness.startswith("raise"):
            problem = f"--dist-ckpt-strictness {strictness}: {text}"
        elif strictness != "ignore_all":
            warn(f" WARNING: --dist-ckpt-strictness {strictness}: {text}; the rest is loaded")
    if strictness.startswith("raise"):
        _raise_if_any(problem, group)
    drop = set(unexpected)
    return [p for p in pieces if p.key not in drop]

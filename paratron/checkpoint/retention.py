"""Which older checkpoints a save removes: ``--ckpt-keep-last K`` (paratron: the newest K complete
checkpoints stay) and ``--save-retain-interval R`` (Megatron: after each save the previous latest
checkpoint is deleted unless its iteration is a multiple of R; with --ckpt-keep-last too, multiples
of R are never counted out by it).

Nothing else is touched: a checkpoint newer than the one just saved (a run resumed with
--ckpt-step), iteration 0, a symbolic link, or a directory without a manifest stay where they are.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Retention:
    keep_last: int = 0  # 0: keep all
    retain_interval: Optional[int] = None

    @staticmethod
    def of(keep) -> "Retention":
        """A Retention from itself or from a --ckpt-keep-last count (the former argument)."""
        return keep if isinstance(keep, Retention) else Retention(int(keep or 0))

    def retained(self, iteration: int) -> bool:
        return self.retain_interval is not None and iteration % self.retain_interval == 0

    def to_remove(self, complete: list[int], iteration: int, previous: Optional[int]) -> list[int]:
        """Iterations to delete after saving ``iteration``: ``complete`` lists the finished checkpoints
        (newest first, ``iteration`` among them), ``previous`` is what the latest marker named before."""
        out = []
        if self.retain_interval is not None and previous is not None and previous in complete:
            if 0 < previous < iteration and not self.retained(previous):
                out.append(previous)
        if self.keep_last > 0:
            out += [it for it in complete[self.keep_last:] if it < iteration and not self.retained(it)
                    and it not in out]
        return out

    def prune(self, root: Path, iter_dir, complete: list[int], iteration: int, previous: Optional[int]) -> None:
        for it in self.to_remove(complete, iteration, previous):
            d = iter_dir(root, it)
            if not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)

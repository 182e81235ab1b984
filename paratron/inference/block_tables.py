"""The paged engine's block tables on the device: one row per running request, written as its blocks are added.

A step's attention finds each token's cached keys through its request's row of ``table`` ([rows + 1, the most
blocks a request holds]; row 0 stays zeros: the scratch block, for padding tokens). A request takes a row at its
first step and keeps it until it finishes (a preempted request's row is taken back when rows run out); each step
writes only the entries of blocks added since the request's last step (one small copy), so neither the host nor
the copy grows with the model's context or the number of running requests. A request that was preempted has its
row written again from its first block, and so are the blocks a request got after giving some back
(``truncate``: speculative decoding's rejected drafts).
"""
from __future__ import annotations

from typing import Callable

import torch


class BlockTables:
    """``rows`` request rows of ``width`` blocks on ``device``; ``to_device(list)``: the engine's copy to the device;
    ``running()``: the requests running now (the rows of the others may be taken back)."""

    def __init__(self, rows: int, width: int, device, to_device: Callable, running: Callable):
        self.table = torch.zeros(rows + 1, width, dtype=torch.long, device=device)
        self.width, self.to_device, self.running = width, to_device, running
        self.free = list(range(rows, 0, -1))
        self.held: dict = {}  # seq id -> [row, entries written, the request's preemptions then, the request]

    def rows_for(self, seqs: list) -> list[int]:
        """The row of each of ``seqs`` (taken at its first step), their new block entries written."""
        out, at, blocks = [], [], []
        for seq in seqs:
            h = self.held.get(seq.id)
            if h is None or h[2] != seq.preempted:
                h = self.held[seq.id] = [self._take() if h is None else h[0], 0, seq.preempted, seq]
            h[1] = min(h[1], len(seq.blocks))  # (blocks given back since: rewritten when they grow again)
            if len(seq.blocks) > h[1]:
                at += range(h[0] * self.width + h[1], h[0] * self.width + len(seq.blocks))
                blocks += seq.blocks[h[1]:]
                h[1] = len(seq.blocks)
            out.append(h[0])
        if at:
            self.table.view(-1).index_copy_(0, self.to_device(at), self.to_device(blocks))
        return out

    def truncate(self, seq, keep: int) -> None:
        """``seq`` gave back its blocks after the first ``keep`` (rejected drafts' slots): the next blocks it gets
        are written again."""
        h = self.held.get(seq.id)
        if h is not None:
            h[1] = min(h[1], keep)

    def release(self, seq) -> None:
        """``seq`` finished: its row is free."""
        h = self.held.pop(seq.id, None)
        if h is not None:
            self.free.append(h[0])

    def clear(self) -> None:
        for h in self.held.values():
            self.free.append(h[0])
        self.held.clear()

    def _take(self) -> int:
        if not self.free:  # rows of preempted requests (waiting) back
            running = {id(s) for s in self.running()}
            for sid, h in list(self.held.items()):
                if id(h[3]) not in running:
                    self.release(h[3])
        if not self.free:
            raise RuntimeError("more running requests than block-table rows (a bug of the paged engine)")
        return self.free.pop()

"""The paged engine's block tables on the device (inference/block_tables.py): a row per running request, only the
entries of new blocks copied each step, rows back at the end, rewritten after a preemption or a roll-back."""
from __future__ import annotations

import torch

from paratron.inference.block_tables import BlockTables
from paratron.inference.scheduler import Seq


def tables(rows: int = 2, width: int = 5):
    copied: list = []

    def to_device(x):
        copied.append(len(x))
        return torch.tensor(x)
    running: list = []
    return BlockTables(rows, width, "cpu", to_device, lambda: running), copied, running


def test_rows_hold_each_request_blocks_and_only_new_entries_are_copied():
    t, copied, running = tables()
    a, b = Seq(0, None, 4, blocks=[7, 8]), Seq(1, None, 4, blocks=[9])
    running += [a, b]
    rows = t.rows_for([a, b])
    assert sorted(rows) == [1, 2] and t.table[rows[0], :2].tolist() == [7, 8] and t.table[rows[1], 0] == 9
    assert copied == [3, 3] and not t.table[0].any()  # one copy of positions and one of blocks; row 0 untouched
    a.blocks.append(4)
    assert t.rows_for([a, b]) == rows and copied[-1] == 1 and t.table[rows[0], 2] == 4
    copied.clear()
    t.rows_for([a, b])
    assert copied == []  # nothing new: nothing copied


def test_preemption_roll_back_release_and_reclaim():
    t, copied, running = tables()
    a, b = Seq(0, None, 4, blocks=[7, 8]), Seq(1, None, 4, blocks=[9])
    running += [a, b]
    row_a = t.rows_for([a, b])[0]
    a.preempted, a.blocks = 1, [3]  # preempted and admitted again: written from its first block
    assert t.rows_for([a])[0] == row_a and t.table[row_a, 0] == 3
    a.blocks += [5, 6]
    t.rows_for([a])
    del a.blocks[1:]
    t.truncate(a, 1)  # rejected drafts' blocks given back, another one taken at the same place
    a.blocks.append(11)
    t.rows_for([a])
    assert t.table[row_a, :2].tolist() == [3, 11]
    t.release(b)
    c = Seq(2, None, 4, blocks=[12])
    running[:] = [a, c]
    assert t.rows_for([c]) != [row_a]  # b's row, free again
    d = Seq(3, None, 4, blocks=[13])
    running[:] = [c, d]  # a is no longer running (preempted, waiting): its row is taken back when none is free
    assert t.rows_for([d]) == [row_a] and t.table[row_a, 0] == 13

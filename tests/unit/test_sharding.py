"""ShardSpec: how a parameter is laid out over ranks, and checkpoint pieces of any such layout
(N-D tensors, uneven blocks, several split dimensions) resharding to another layout."""
from __future__ import annotations

import itertools

import torch

from paratron.checkpoint import sharded
from paratron.checkpoint.pieces import flat_pieces, tensor_pieces
from paratron.parallel.sharding import ShardSpec, Split, flat_rectangles, local_index, shard


def test_split_parts_even_uneven_and_blocks():
    assert Split(0, "tp", (8,)).parts(1, 2) == [(4, 4)]
    assert Split(0, "tp", (4, 4)).parts(1, 2) == [(2, 2), (6, 2)]  # SwiGLU-style [gate; up]
    assert [Split(0, "tp", (7,)).parts(r, 3) for r in range(3)] == [[(0, 2)], [(2, 2)], [(4, 3)]]
    assert Split(0, "tp", (2, 4)).parts(0, 3) == [(2, 1)]  # an empty part of the first block
    # every global index is held by exactly one rank
    s = Split(0, "x", (5, 3, 6))
    held = torch.cat([local_index(s, r, 4) for r in range(4)])
    assert sorted(held.tolist()) == list(range(14))


def test_flat_rectangles_cover_exactly_the_range():
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (3, 5), (2, 3, 4), (3, 1, 2, 5)]:
        n = int(torch.Size(shape).numel())
        for _ in range(20):
            lo, hi = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
            mark = torch.zeros(shape, dtype=torch.int64)
            flat = torch.arange(n).view(shape)
            for offsets, sizes, start in flat_rectangles(shape, lo, hi):
                idx = tuple(slice(o, o + k) for o, k in zip(offsets, sizes))
                mark[idx] += 1
                assert flat[idx].reshape(-1)[0].item() == start  # contiguous from its flat start
                assert flat[idx].reshape(-1).tolist() == list(range(start, start + flat[idx].numel()))
            want = torch.zeros(n, dtype=torch.int64)
            want[lo:hi] = 1
            assert torch.equal(mark.view(-1), want), (shape, lo, hi)


LAYOUT_A = ShardSpec(splits=(Split(0, "a", (4, 2)), Split(2, "b", (7,))))  # rows in 2 uneven blocks, cols 2/2/3
LAYOUT_B = ShardSpec(splits=(Split(1, "a", (5,)), Split(0, "c", (2, 4))))  # another split of other dimensions
SIZES_A, SIZES_B = {"a": 2, "b": 3}, {"a": 2, "c": 3}


def _ranks(sizes: dict):
    names = list(sizes)
    for combo in itertools.product(*[range(sizes[n]) for n in names]):
        yield {n: (r, sizes[n]) for n, r in zip(names, combo)}


def test_a_3d_tensor_split_unevenly_over_two_dims_reshards_to_another_split(tmp_path):
    full = torch.randn(6, 5, 7, generator=torch.Generator().manual_seed(1))
    pieces = []
    for coords in _ranks(SIZES_A):
        local = shard(full, LAYOUT_A, coords)
        # the model weight whole, and a distributed-optimizer-like flat range of it cut in two
        pieces += tensor_pieces("model.w", local, LAYOUT_A, coords)
        flat, cut = local.reshape(-1), local.numel() // 3
        pieces += flat_pieces("optim.w", flat[:cut], local.shape, 0, LAYOUT_A, coords)
        pieces += flat_pieces("optim.w", flat[cut:], local.shape, cut, LAYOUT_A, coords)
    sharded.save(tmp_path, 1, pieces, {})
    d = sharded.find_checkpoint(tmp_path)
    targets, wanted = [], []
    for coords in _ranks(SIZES_B):
        expect = shard(full, LAYOUT_B, coords)
        got_w, got_o = torch.zeros_like(expect), torch.zeros_like(expect)
        targets += tensor_pieces("model.w", got_w, LAYOUT_B, coords)
        cut = got_o.numel() // 2
        targets += flat_pieces("optim.w", got_o.view(-1)[cut:], got_o.shape, cut, LAYOUT_B, coords)
        targets += flat_pieces("optim.w", got_o.view(-1)[:cut], got_o.shape, 0, LAYOUT_B, coords)
        wanted.append((expect, got_w, got_o))
    sharded.load(d, targets)
    assert [e.shape[0] for e, _, _ in wanted[:3]] == [1, 2, 3]  # the uneven split of dim 0 in layout B
    for expect, got_w, got_o in wanted:
        assert torch.equal(got_w, expect)
        assert torch.equal(got_o, expect)

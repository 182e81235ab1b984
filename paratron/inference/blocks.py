"""The paged KV cache's block allocator: fixed-size blocks of one pool, a free list, reference counts, and the
prefix cache (full blocks found again by the hash chain of their tokens).

Block 0 is never handed out: padding rows of a CUDA-graphed step write their keys there. A request holds a
list of block ids (its block table); token ``p`` of it lives in slot ``p % block_size`` of block
``table[p // block_size]``.

Prefix caching: a full block's key is sha256(key of the block before it, its tokens), so equal keys mean
equal prefixes (the whole chain, not just the block). A request about to be prefilled looks its prompt's full
blocks up in order and takes the ones found (a reference more each) instead of computing them. A block whose
last reference is released is, under the ``lru`` policy, kept with its key (evictable, least recently
released first) until the allocator needs it; under ``ref_zero`` it is forgotten at once (Megatron's two
policies): blocks are then shared only between requests that run at the same time.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Optional

SCRATCH = 0  # the block that padding rows write into


def chain_keys(tokens: list, block_size: int, count: int, start: bytes = b"") -> list[bytes]:
    """The keys of the first ``count`` full blocks of ``tokens``: each hashes the one before it and its tokens."""
    keys, parent = [], start
    for j in range(count):
        block = tokens[j * block_size:(j + 1) * block_size]
        parent = hashlib.sha256(parent + b"|" + ",".join(map(str, block)).encode()).digest()
        keys.append(parent)
    return keys


class BlockAllocator:
    """``num_blocks`` blocks of ``block_size`` tokens; ``prefix_caching``: keep full blocks findable by key."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, policy: str = "ref_zero"):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching, self.policy = prefix_caching, policy
        self.free: collections.deque = collections.deque(range(1, num_blocks))
        self.refs = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}
        self.by_key: dict[bytes, int] = {}
        self.evictable: collections.OrderedDict = collections.OrderedDict()  # LRU: oldest release first
        self.peak = 0  # most blocks held at once

    @property
    def available(self) -> int:
        """Blocks that ``allocate`` can hand out (free, or cached and unreferenced)."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - self.available

    def allocate(self, n: int) -> Optional[list[int]]:
        """``n`` blocks with one reference each, or None (nothing taken) when fewer are available."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._forget(b)
            self.refs[b] = 1
            out.append(b)
        self.peak = max(self.peak, self.used)
        return out

    def release(self, blocks: list[int]) -> None:
        """One reference less on each block; unreferenced ones become evictable (lru, with a key) or free."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] > 0:
                continue
            if b in self.key_of and self.policy == "lru":
                self.evictable[b] = None
            else:
                self._forget(b)
                self.free.append(b)

    def _forget(self, b: int) -> None:
        key = self.key_of.pop(b, None)
        if key is not None and self.by_key.get(key) == b:
            del self.by_key[key]

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``keys`` from the first, each with a reference more."""
        if not self.prefix_caching:
            return []
        out = []
        for key in keys:
            b = self.by_key.get(key)
            if b is None:
                break
            if self.refs[b] == 0:
                self.evictable.pop(b, None)
            self.refs[b] += 1
            out.append(b)
        self.peak = max(self.peak, self.used)
        return out

    def register(self, block: int, key: bytes) -> None:
        """``block`` (full) holds the tokens of ``key``: later requests may find it (the first block of a key
        stays its one)."""
        if self.prefix_caching and key not in self.by_key and block not in self.key_of:
            self.by_key[key] = block
            self.key_of[block] = key

"""Checks of a dataset before training reads it: every token id must index the vocabulary.

The largest (and smallest) token id of ``PREFIX.bin`` is computed once, in chunks (the file is
memory-mapped, never loaded whole), and cached beside the index as ``PREFIX.idx.tokens.json``
together with the sizes and modification times of both files, so a changed dataset is scanned
again. A directory that cannot be written just goes without the cache.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from paratron.data.errors import DataError
from paratron.data.indexed import IndexedDataset, bin_path, idx_path

CHUNK = 1 << 24  # tokens per numpy reduction


def _cache_path(prefix: str) -> str:
    return idx_path(prefix) + ".tokens.json"


def _stamp(prefix: str) -> dict:
    out = {}
    for name, path in (("idx", idx_path(prefix)), ("bin", bin_path(prefix))):
        st = os.stat(path)
        out[name] = [st.st_size, st.st_mtime_ns]
    return out


def _read_cache(prefix: str, stamp: dict) -> Optional[tuple[int, int]]:
    try:
        with open(_cache_path(prefix)) as f:
            data = json.load(f)
        if data.get("stamp") == stamp:
            return int(data["min"]), int(data["max"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_cache(prefix: str, stamp: dict, lo: int, hi: int) -> None:
    path = _cache_path(prefix)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({"stamp": stamp, "min": lo, "max": hi}, f)
        os.replace(tmp, path)
    except OSError:  # a read-only dataset directory: no cache
        try:
            os.remove(tmp)
        except OSError:
            pass


def token_id_range(ds: IndexedDataset, use_cache: bool = True) -> Optional[tuple[int, int]]:
    """(smallest, largest) token id in ``ds``'s data file; None when it holds no tokens."""
    tokens = ds._bin
    if tokens.size == 0:
        return None
    stamp = _stamp(ds.prefix)
    cached = _read_cache(ds.prefix, stamp) if use_cache else None
    if cached is not None:
        return cached
    lo, hi = None, None
    for start in range(0, tokens.size, CHUNK):
        part = tokens[start:start + CHUNK]
        a, b = int(part.min()), int(part.max())
        lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    if use_cache:
        _write_cache(ds.prefix, stamp, lo, hi)
    return lo, hi


def check_token_ids(ds: IndexedDataset, vocab_size: int) -> None:
    """A :class:`DataError` (one line, both numbers) when a token id of ``ds`` is not in [0, vocab_size)."""
    found = token_id_range(ds)
    if found is None:
        return
    lo, hi = found
    if hi >= vocab_size:
        raise DataError(f"{bin_path(ds.prefix)} holds token id {hi}, but the vocabulary has {vocab_size} ids "
                        f"(0..{vocab_size - 1}): the data was tokenized with another tokenizer; preprocess it with "
                        "this run's tokenizer or set the matching --tokenizer-type / --vocab-size")
    if lo < 0:
        raise DataError(f"{bin_path(ds.prefix)} holds token id {lo}, but token ids must be in 0..{vocab_size - 1}: "
                        "the file is corrupted or not a token file")

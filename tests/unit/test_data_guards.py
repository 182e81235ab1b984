"""Issue 49's damaged data files: garbled .idx lengths and pointers are one line naming the file and the
first bad sequence (instead of training on shifted tokens); a damaged index cache file under
--data-cache-path is rebuilt with a warning naming it, or is one line when it cannot be rewritten."""
import errno
import logging
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import StubTokenizer, build_datasets, data_args, random_documents  # noqa: E402

from paratron.data import DataError  # noqa: E402
from paratron.data import gpt_dataset as pgd  # noqa: E402
from paratron.data.indexed import HEADER_SIZE, IndexedDataset, write_dataset  # noqa: E402

N_DOCS = 20


def _dataset(tmp_path) -> str:
    prefix = str(tmp_path / "d")
    write_dataset(prefix, random_documents(N_DOCS, seed=3, max_len=50))
    return prefix


def _poke(prefix: str, offset: int, dtype, value) -> None:
    """Overwrite one entry of the .idx in place (the sizes of both files stay right)."""
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(np.array([value], dtype=dtype).tobytes())


def _error(prefix: str) -> str:
    with pytest.raises(DataError) as info:
        IndexedDataset(prefix)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_garbled_lengths_are_one_line_naming_the_index_and_the_sequence(tmp_path):
    prefix = _dataset(tmp_path)
    lengths = IndexedDataset(prefix).sequence_lengths.copy()
    # lengths 5 and 6 swapped: the total (and so the .bin size) is unchanged, but sequence 6 starts elsewhere
    _poke(prefix, HEADER_SIZE + 5 * 4, np.int32, lengths[6])
    _poke(prefix, HEADER_SIZE + 6 * 4, np.int32, lengths[5])
    if lengths[5] == lengths[6]:
        pytest.skip("equal lengths")
    msg = _error(prefix)
    assert "d.idx: corrupt index at sequence 6 (document 6)" in msg, msg


def test_a_pointer_past_the_bin_is_one_line(tmp_path):
    prefix = _dataset(tmp_path)
    bin_size = os.path.getsize(prefix + ".bin")
    _poke(prefix, HEADER_SIZE + N_DOCS * 4 + 3 * 8, np.int64, bin_size + 1000)
    msg = _error(prefix)
    assert f"corrupt index at sequence 3 (document 3): length" in msg and f"at byte {bin_size + 1000}" in msg, msg


def test_a_negative_length_is_one_line(tmp_path):
    prefix = _dataset(tmp_path)
    _poke(prefix, HEADER_SIZE + 2 * 4, np.int32, -7)
    assert "corrupt index at sequence 2 (document 2): length -7" in _error(prefix)


def test_a_sound_index_opens_and_reads_what_was_written(tmp_path):
    prefix = str(tmp_path / "ok")
    docs = random_documents(N_DOCS, seed=3, max_len=50)
    write_dataset(prefix, docs)
    ds = IndexedDataset(prefix)
    assert all(np.array_equal(ds[i], d) for i, d in enumerate(docs))


def _cache(tmp_path):
    prefix = _dataset(tmp_path)
    cache = tmp_path / "cache"
    args = data_args(data_path=[prefix], data_cache_path=str(cache))
    first = build_datasets(args, StubTokenizer())
    shuffle = next(p for p in cache.iterdir() if p.name.endswith("-GPTDataset-train-shuffle_index.npy"))
    return args, first, shuffle


@pytest.mark.parametrize("damage", ["truncated", "header_only", "empty"])
def test_a_damaged_index_cache_file_is_rebuilt_with_a_warning_naming_it(tmp_path, caplog, damage):
    args, first, shuffle = _cache(tmp_path)
    raw = shuffle.read_bytes()
    shuffle.write_bytes({"truncated": raw[:len(raw) // 2], "header_only": raw[:128], "empty": b""}[damage])
    with caplog.at_level(logging.WARNING, logger="paratron.data.gpt_dataset"):
        second = build_datasets(args, StubTokenizer())
    assert f"damaged GPTDataset index cache file {shuffle} (" in caplog.text, caplog.text
    assert np.array_equal(np.asarray(first[0].shuffle_index), np.asarray(second[0].shuffle_index))
    assert shuffle.read_bytes() == raw  # rewritten whole


def test_a_damaged_index_cache_file_that_cannot_be_rewritten_is_one_line(tmp_path, monkeypatch):
    args, _, shuffle = _cache(tmp_path)
    shuffle.write_bytes(shuffle.read_bytes()[:100])

    def read_only(path, array):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    monkeypatch.setattr(pgd, "save_array", read_only)
    with pytest.raises(DataError) as info:
        build_datasets(args, StubTokenizer())
    msg = str(info.value)
    assert "\n" not in msg and f"the index cache file {shuffle} is damaged (" in msg, msg
    assert "cannot be rebuilt in" in msg and "EROFS" in msg and "--data-cache-path" in msg, msg

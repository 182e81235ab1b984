"""The .bin/.idx format: round trips, byte-compatibility with megatron-core, and bad files."""

import os
import pickle
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import import_mcore_datasets, random_documents  # noqa: E402

from paratron.data import DataError  # noqa: E402
from paratron.data.indexed import (  # noqa: E402
    IndexedDataset, IndexedDatasetWriter, merge_datasets, token_dtype, write_dataset,
)

MCORE = import_mcore_datasets()
needs_mcore = pytest.mark.skipif(MCORE is None, reason="megatron-core not importable")


def _docs_with_empty(n=60, seed=0):
    docs = random_documents(n, seed)
    docs[5] = np.array([], dtype=np.int64)  # an empty document: no sequence, one index entry
    return docs


def test_round_trip_and_layout(tmp_path):
    docs = _docs_with_empty()
    prefix = str(tmp_path / "d")
    write_dataset(prefix, docs)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert ds.num_documents == len(docs) and len(ds) == len(docs) - 1
    for i, doc in enumerate(docs):
        assert np.array_equal(ds.document(i), doc)
    assert ds.get(0, offset=3, length=4).tolist() == docs[0][3:7].tolist()
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<QBQQ", raw, 9) == (1, 8, len(ds), len(docs) + 1)
    assert os.path.getsize(prefix + ".bin") == 2 * sum(len(d) for d in docs)
    assert ds.sequence_pointers[1] == 2 * ds.sequence_lengths[0]
    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers get it by path
    assert np.array_equal(clone[7], ds[7])


def test_token_dtype_rule():
    assert token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32
    assert token_dtype(None) == np.int32


def test_merge(tmp_path):
    a, b = random_documents(10, 1), random_documents(7, 2)
    write_dataset(str(tmp_path / "a"), a)
    write_dataset(str(tmp_path / "b"), b)
    merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab"))
    ab = IndexedDataset(str(tmp_path / "ab"))
    assert ab.num_documents == 17
    assert ab.document_indices.tolist() == list(range(18))
    for i, doc in enumerate(a + b):
        assert np.array_equal(ab.document(i), doc)


def test_writer_abort_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


@needs_mcore
def test_paratron_written_read_by_megatron(tmp_path):
    docs = _docs_with_empty()
    prefix = str(tmp_path / "p")
    write_dataset(prefix, docs, dtype=np.int32)
    theirs = MCORE.indexed.IndexedDataset(prefix)
    ours = IndexedDataset(prefix)
    assert len(theirs) == len(ours)
    assert np.array_equal(theirs.document_indices, ours.document_indices)
    assert np.array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    for i in range(len(ours)):
        assert np.array_equal(theirs[i], ours[i])
        assert theirs[i].dtype == np.int32


@needs_mcore
def test_megatron_written_read_by_paratron_bytes_identical(tmp_path):
    docs = _docs_with_empty()
    builder = MCORE.indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for doc in docs:
        builder.add_document(doc, [len(doc)] if len(doc) else [])
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDataset(str(tmp_path / "m"))
    for i, doc in enumerate(docs):
        assert np.array_equal(ours.document(i), doc)
    write_dataset(str(tmp_path / "p"), docs)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"m{ext}").read_bytes() == (tmp_path / f"p{ext}").read_bytes()


@needs_mcore
def test_megatron_merge_matches(tmp_path):
    write_dataset(str(tmp_path / "a"), random_documents(5, 3))
    write_dataset(str(tmp_path / "b"), random_documents(4, 4))
    builder = MCORE.indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    builder.add_index(str(tmp_path / "a"))
    builder.add_index(str(tmp_path / "b"))
    builder.finalize(str(tmp_path / "m.idx"))
    merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "p"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"m{ext}").read_bytes() == (tmp_path / f"p{ext}").read_bytes()


def _one_line_error(prefix, *needles):
    with pytest.raises(DataError) as info:
        IndexedDataset(prefix)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_truncated_bin(tmp_path):
    prefix = str(tmp_path / "t")
    write_dataset(prefix, random_documents(20))
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 10)
    _one_line_error(prefix, "t.bin", "truncated")


def test_truncated_idx(tmp_path):
    prefix = str(tmp_path / "t")
    write_dataset(prefix, random_documents(20))
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(100)
    _one_line_error(prefix, "t.idx", "truncated")
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(20)
    _one_line_error(prefix, "t.idx", "truncated")


def test_wrong_magic_and_version(tmp_path):
    prefix = str(tmp_path / "w")
    write_dataset(prefix, random_documents(5))
    raw = bytearray(open(prefix + ".idx", "rb").read())
    (tmp_path / "w.idx").write_bytes(b"NOTMAGIC!" + raw[9:])
    _one_line_error(prefix, "w.idx", "magic")
    raw[9] = 7
    (tmp_path / "w.idx").write_bytes(bytes(raw))
    _one_line_error(prefix, "w.idx", "version 7")
    (tmp_path / "w.idx").write_bytes(b"")
    _one_line_error(prefix, "w.idx", "empty")


def test_missing_files(tmp_path):
    _one_line_error(str(tmp_path / "none"), "none.idx", "no such")
    prefix = str(tmp_path / "m")
    write_dataset(prefix, random_documents(3))
    os.remove(prefix + ".bin")
    _one_line_error(prefix, "m.bin", "no such")

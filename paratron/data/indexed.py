"""Megatron's indexed dataset: `PREFIX.bin` (tokens) + `PREFIX.idx` (index), byte-compatible.

`.idx` layout (little-endian): magic b"MMIDIDX\\x00\\x00", version uint64 = 1, token dtype code
uint8, sequence count N uint64, document count D uint64, then int32 sequence_lengths[N],
int64 sequence_pointers[N] (byte offsets into .bin), int64 document_indices[D] (0, ..., N).
`.bin` is the tokens of every sequence back to back, no header.

The reader maps both files with numpy (nothing is loaded whole) and checks them on open so that a
truncated or foreign file is a one-line `DataError`, not a crash deep inside training. The writer
writes under temporary names and renames only in `finalize()`, so an interrupted write leaves no
half-written dataset behind.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from typing import Iterable, Optional, Sequence

import numpy as np

from paratron.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_OF_CODE = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_OF_CODE.items()}


def token_dtype(vocab_size: Optional[int]) -> np.dtype:
    """The token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def _read_header(path: str):
    """Check the fixed header of an .idx file; return (dtype, sequence count, document count)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such index file")
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if not head:
        raise DataError(f"{path}: empty index file")
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise DataError(f"{path}: not a Megatron indexed-dataset index (bad magic bytes)")
    if len(head) < HEADER_SIZE:
        raise DataError(f"{path}: truncated index ({len(head)} bytes, header needs {HEADER_SIZE})")
    (version,) = struct.unpack_from("<Q", head, len(MAGIC))
    if version != VERSION:
        raise DataError(f"{path}: unsupported index version {version} (expected {VERSION})")
    code = head[len(MAGIC) + 8]
    if code not in DTYPE_OF_CODE:
        raise DataError(f"{path}: unknown token dtype code {code}")
    count, docs = struct.unpack_from("<QQ", head, len(MAGIC) + 9)
    return DTYPE_OF_CODE[code], int(count), int(docs)


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx. `ds[i]` is sequence i as a numpy array (a view of the
    mapped file); `ds.get(i, offset, length)` a slice of it. Pickles by path (cheap to send to
    DataLoader workers)."""

    def __init__(self, prefix: str, multimodal: bool = False, mmap_bin: bool = True):
        """``mmap_bin`` False (--no-mmap-bin-files): each read is a file read instead of a view of
        the memory-mapped .bin."""
        self.prefix = str(prefix)
        self.multimodal = multimodal
        self.mmap_bin = mmap_bin
        self._open()

    def _open(self) -> None:
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        dtype, n, d = _read_header(ipath)
        self.dtype = dtype
        idx_size = os.path.getsize(ipath)
        arrays = n * 4 + n * 8 + d * 8
        expected = HEADER_SIZE + arrays + (n if self.multimodal else 0)
        # A multimodal index (trailing int8 modes) is still readable as a plain one.
        if idx_size != expected and not (not self.multimodal and idx_size == expected + n):
            what = "truncated" if idx_size < expected else "has trailing bytes"
            raise DataError(
                f"{ipath}: index {what}: {idx_size} bytes, but its header ({n} sequences, "
                f"{d} document entries) needs {expected}"
            )
        if d < 1:
            raise DataError(f"{ipath}: corrupt index: document count is 0 (must be at least 1)")
        buf = np.memmap(ipath, dtype=np.uint8, mode="r") if idx_size else np.empty(0, np.uint8)
        self._idx_buf = buf
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, np.int32, n, off)
        off += n * 4
        self.sequence_pointers = np.frombuffer(buf, np.int64, n, off)
        off += n * 8
        self.document_indices = np.frombuffer(buf, np.int64, d, off)
        off += d * 8
        self.sequence_modes = np.frombuffer(buf, np.int8, n, off) if self.multimodal else None
        if self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise DataError(
                f"{ipath}: corrupt index: document indices must run from 0 to {n}, found "
                f"{int(self.document_indices[0])}..{int(self.document_indices[-1])}"
            )
        if np.any(np.diff(self.document_indices) < 0):
            raise DataError(f"{ipath}: corrupt index: document indices decrease at document "
                            f"{int(np.flatnonzero(np.diff(self.document_indices) < 0)[0])}")
        if not os.path.isfile(bpath):
            raise DataError(f"{bpath}: no such data file (the index {ipath} exists)")
        bin_size = os.path.getsize(bpath)
        need = self._check_layout(ipath)
        if bin_size != need:
            what = "truncated" if bin_size < need else "longer than its index says"
            raise DataError(f"{bpath}: data file {what}: {bin_size} bytes, index needs {need}")
        self._bin = np.memmap(bpath, dtype=dtype, mode="r") if bin_size and self.mmap_bin else np.empty(0, dtype)

    def _check_layout(self, ipath: str, chunk: int = 1 << 22) -> int:
        """The .bin size the index describes, after checking (one vectorised pass, in chunks) that the
        sequences lie back to back from byte 0 (as every writer puts them): each length >= 0 and each
        pointer the previous pointer plus the previous length (the caller compares the end with the
        .bin's size). Garbled lengths or pointers would otherwise read shifted tokens without a word."""
        lengths, pointers, item = self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize
        at = 0  # the byte where the next sequence must start
        for lo in range(0, len(lengths), chunk):
            size = lengths[lo:lo + chunk].astype(np.int64) * item
            expect = at + np.cumsum(size) - size
            bad = np.flatnonzero((size < 0) | (pointers[lo:lo + chunk] != expect))
            if len(bad):
                i = lo + int(bad[0])
                doc = int(np.searchsorted(self.document_indices, i, side="right")) - 1
                raise DataError(
                    f"{ipath}: corrupt index at sequence {i} (document {doc}): length {int(lengths[i])} at byte "
                    f"{int(pointers[i])}, but the sequences before it end at byte {int(expect[bad[0]])}; rebuild "
                    "the dataset (tools/preprocess_data.py)")
            at += int(size.sum())
        return at

    def __getstate__(self):
        return {"prefix": self.prefix, "multimodal": self.multimodal, "mmap_bin": self.mmap_bin}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self.multimodal = state["multimodal"]
        self.mmap_bin = state.get("mmap_bin", True)
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` (to its end when length is None)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + int(offset)
        return self._tokens(start, int(length))

    def _tokens(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the .bin file."""
        if self.mmap_bin or count <= 0:
            return self._bin[start : start + count]
        with open(bin_path(self.prefix), "rb") as f:
            f.seek(start * self.dtype.itemsize)
            return np.fromfile(f, dtype=self.dtype, count=count)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (its sequences concatenated)."""
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if lo == hi:
            return self._bin[:0]
        start = int(self.sequence_pointers[lo]) // self.dtype.itemsize
        count = int(self.sequence_lengths[lo:hi].sum(dtype=np.int64))
        return self._tokens(start, count)


class IndexedDatasetWriter:
    """Write PREFIX.bin/.idx. Data goes to temporary files next to the target; `finalize()`
    writes the index and renames both into place; `abort()` (or an exception inside a `with`
    block) removes the temporaries."""

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise DataError(f"{self.prefix}: token dtype {self.dtype} has no indexed-dataset code")
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = bin_path(self.prefix) + tag
        self._idx_tmp = idx_path(self.prefix) + tag
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = array("i")  # int32 per sequence
        self._doc_ends = array("q", [0])  # int64, document_indices
        self._done = False

    # -- adding data -------------------------------------------------------------------------
    def add_sequence(self, tokens) -> None:
        """Append one sequence; call `end_document()` after the last sequence of a document."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        self._doc_ends.append(len(self._lengths))

    def add_document(self, tokens, lengths: Optional[Sequence[int]] = None) -> None:
        """Append one document. `lengths` splits it into sequences (sentences); by default a
        non-empty document is one sequence and an empty one has none (as Megatron writes it)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if lengths is None:
            lengths = [arr.size] if arr.size else []
        if sum(lengths) != arr.size:
            raise ValueError(f"sequence lengths sum to {sum(lengths)}, document has {arr.size}")
        self._bin.write(arr.tobytes())
        self._lengths.extend(int(x) for x in lengths)
        self._doc_ends.append(len(self._lengths))

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: Sequence[int], sequences_per_doc: Sequence[int]
    ) -> None:
        """Append many documents at once: `tokens` concatenated, each sequence's length, and how
        many sequences each document has (0 for an empty document)."""
        arr = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._bin.write(arr.data)
        base = len(self._lengths)
        self._lengths.extend(sequence_lengths)
        ends = base + np.cumsum(np.asarray(sequences_per_doc, dtype=np.int64))
        self._doc_ends.extend(ends.tolist())

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (merging): its bytes, its sequence lengths, and its
        document indices shifted by the sequences already here."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{idx_path(prefix)}: token dtype {other.dtype} differs from {self.dtype}; "
                "cannot merge datasets of different dtypes"
            )
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._doc_ends.extend((other.document_indices[1:] + offset).tolist())
        with open(bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)

    # -- closing -----------------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return len(self._doc_ends) - 1

    def finalize(self) -> None:
        if self._done:
            return
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.empty(
            0, np.int32
        )
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self._doc_ends)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.frombuffer(self._doc_ends, dtype=np.int64).tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_dataset(prefix: str, documents: Iterable, dtype=np.uint16) -> None:
    """Write documents (each a 1-D token sequence) as PREFIX.bin/.idx, one sequence each."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)


def merge_datasets(prefixes: Sequence[str], out_prefix: str) -> None:
    """Concatenate datasets (same dtype) into OUT_PREFIX.bin/.idx, in the given order."""
    if not prefixes:
        raise DataError("merge_datasets: no input datasets given")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(out_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)

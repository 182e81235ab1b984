"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), in Megatron's layout:

    {root}/latest_checkpointed_iteration.txt     the newest complete iteration, replaced atomically
    {root}/iter_0000100/.metadata                DCP's index of every tensor chunk
    {root}/iter_0000100/__{rank}_{n}.distcp      the chunks each rank wrote
    {root}/iter_0000100/common.json              iteration, samples, scheduler, config, ... (rank 0)
    {root}/iter_0000100/metadata.json            written last: size and CRC-32 of every file above

Every tensor is stored as a *global* tensor (the shape it has in the one-rank model) under a name
that does not depend on the layout; each rank contributes the rectangular chunks it holds, with
their offsets in the global tensor (a :class:`Piece`). Chunks held by several ranks (data-parallel
replicas, TP-replicated norms) are written once. Loading asks DCP for the chunks this rank needs in
*its* layout, and DCP reads whichever saved chunks overlap them: that is the resharding, for
tensor, pipeline and data parallelism and for the distributed optimizer's flat shards alike
(:func:`flat_pieces` cuts a flat range of a parameter into rectangles of the global tensor).

A save goes to ``.iter_0000100.partial/``; when every rank's chunks and DCP's ``.metadata`` are
written, rank 0 writes ``metadata.json`` (file sizes and checksums), renames the directory to
``iter_0000100`` and only then replaces the latest marker, so a crash at any point leaves the
previous checkpoint as latest. :class:`AsyncSave` runs the same steps in a background thread on
CPU copies of the tensors, over a separate gloo group so it never interleaves with training's
collectives. Loading checks sizes and checksums first; a damaged checkpoint is named in the error,
and :func:`find_checkpoint` falls back to the previous complete one.

Nothing is unpickled from disk except DCP's ``.metadata`` index, and that through an unpickler that
only builds DCP's own metadata classes (:class:`_MetadataUnpickler`); tensors are read with
``weights_only=True`` and everything else is JSON.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, SavePlan, SavePlanner, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
MANIFEST = "metadata.json"
FORMAT = "paratron-torch_dist-1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file or the tensor."""


# ----------------------------------------------------------------------------------------------
# Pieces: a rank's rectangular chunks of global tensors
# ----------------------------------------------------------------------------------------------

@dataclass
class Piece:
    key: str  # layout-independent name
    shape: tuple  # of the global tensor
    offsets: tuple  # of this chunk in the global tensor
    tensor: torch.Tensor  # this rank's chunk (a view: loading writes through it)
    vocab_rows: bool = False  # dim 0 is the padded vocabulary (its size may differ between layouts)


def _rectangles(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """Elements [lo, hi) of a row-major tensor of ``shape`` (1-D or 2-D) as rectangles
    (offsets, sizes, flat start), each contiguous in the flattened tensor."""
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)] if hi > lo else []
    if len(shape) != 2:
        raise ValueError(f"sharded checkpoints handle 1-D and 2-D tensors; got shape {tuple(shape)}")
    cols = shape[1]
    r0, c0 = divmod(lo, cols)
    r1, c1 = divmod(hi, cols)
    if r0 == r1:
        return [((r0, c0), (1, c1 - c0), lo)] if c1 > c0 else []
    out = []
    if c0:
        out.append(((r0, c0), (1, cols - c0), lo))
        r0 += 1
    if r1 > r0:
        out.append(((r0, 0), (r1 - r0, cols), r0 * cols))
    if c1:
        out.append(((r1, 0), (1, c1), r1 * cols))
    return out


def flat_pieces(key: str, flat: torch.Tensor, local_shape: tuple, lo: int, tp_dim: Optional[int] = None,
                tp_chunks: int = 1, tp_rank: int = 0, tp_size: int = 1, vocab_rows: bool = False) -> list[Piece]:
    """The pieces of ``flat`` = elements [lo, lo + flat.numel()) of this rank's tensor-parallel shard
    (shape ``local_shape``) of a global tensor. The shard is ``tp_chunks`` equal blocks along
    ``tp_dim``; block c of rank r is slice r (of ``tp_size``) of block c of the global tensor (see
    paratron/parallel/tensor.py). ``tp_dim=None``: the tensor is not split (replicated)."""
    local_shape = tuple(local_shape)
    hi = lo + flat.numel()
    split = tp_dim is not None and tp_size > 1
    shape = list(local_shape)
    if split:
        shape[tp_dim] *= tp_size
    out = []
    for offsets, sizes, start in _rectangles(local_shape, lo, hi):
        view = flat[start - lo: start - lo + int(torch.Size(sizes).numel())].view(sizes)
        if not split:
            out.append(Piece(key, tuple(shape), offsets, view, vocab_rows))
            continue
        block = local_shape[tp_dim] // tp_chunks
        a, n = offsets[tp_dim], sizes[tp_dim]
        s = a
        while s < a + n:  # cut at block boundaries: each block maps to its own global range
            c = s // block
            e = min(a + n, (c + 1) * block)
            g = list(offsets)
            g[tp_dim] = c * block * tp_size + tp_rank * block + (s - c * block)
            out.append(Piece(key, tuple(shape), tuple(g), view.narrow(tp_dim, s - a, e - s), vocab_rows))
            s = e
    return out


def tensor_pieces(key: str, t: torch.Tensor, **tp) -> list[Piece]:
    """The pieces of a whole tensor-parallel shard ``t`` (see :func:`flat_pieces`)."""
    if t.dim() == 0:
        return [Piece(key, (), (), t)]
    return flat_pieces(key, t.view(-1), tuple(t.shape), 0, **tp)


def replicated_row(key: str, t: torch.Tensor, row: int, rows: int) -> Piece:
    """Row ``row`` of a [rows, n] global tensor: a per-rank value (an RNG state)."""
    t = t.reshape(1, -1)
    return Piece(key, (rows, t.shape[1]), (row, 0), t)


# ----------------------------------------------------------------------------------------------
# DCP planners over pieces
# ----------------------------------------------------------------------------------------------

def _chunk(p: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.size())


class _PieceSavePlanner(SavePlanner):
    """Writes the given pieces; a chunk held by several ranks is written by one of them, chosen to
    balance the bytes each rank writes."""

    def __init__(self, pieces: list[Piece]):
        self.pieces = {(p.key, tuple(p.offsets)): p for p in pieces}

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(p.key, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=_chunk(p), size=torch.Size(p.shape),
                                                       properties=TensorProperties.create_from_tensor(p.tensor)))
                 for p in self.pieces.values()]
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        owner: dict = {}
        load = [0] * len(all_plans)
        for rank, plan in enumerate(all_plans):  # assign each distinct chunk to its least-loaded holder
            for item in plan.items:
                k = (item.index.fqn, tuple(item.index.offset))
                nbytes = item.tensor_data.chunk.sizes.numel()
                if k not in owner or load[rank] < load[owner[k]]:
                    if k in owner:
                        load[owner[k]] -= nbytes
                    owner[k] = rank
                    load[rank] += nbytes
        plans = [SavePlan([it for it in plan.items if owner[(it.index.fqn, tuple(it.index.offset))] == rank])
                 for rank, plan in enumerate(all_plans)]
        plans, metadata = create_default_global_save_plan(plans)
        for fqn, md in metadata.state_dict_metadata.items():  # every element written exactly once
            covered = sum(c.sizes.numel() for c in md.chunks)
            if covered != md.size.numel():
                raise RuntimeError(f"checkpoint plan for {fqn}: chunks cover {covered} of {md.size.numel()} elements")
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        return self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))].tensor


class _PieceLoadPlanner(LoadPlanner):
    """Reads the saved chunks that overlap each requested piece into the piece's tensor."""

    def __init__(self, pieces: list[Piece], where: str):
        self.where = where
        self.targets: dict = {}
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # the same chunk wanted twice on a rank
        for p in pieces:
            k = (p.key, tuple(p.offsets))
            if k in self.targets:
                self.copies.append((self.targets[k].tensor, p.tensor))
            else:
                self.targets[k] = p

    def set_up_planner(self, state_dict=None, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def problem(self) -> Optional[str]:
        """Why this checkpoint cannot fill the pieces (one line), or None."""
        saved = self.metadata.state_dict_metadata
        for p in self.targets.values():
            md = saved.get(p.key)
            if md is None or not hasattr(md, "chunks"):
                return (f"{self.where} has no tensor {p.key!r} (saved by another model, or without optimizer "
                        "state: then use --no-load-optim)")
            have, want = tuple(md.size), tuple(p.shape)
            if have != want and not (p.vocab_rows and have[1:] == want[1:]):
                return (f"{self.where}: the checkpoint does not fit this model ({p.key} has shape {list(have)} "
                        f"there, {list(want)} here); pass the model flags (and tokenizer) of the saved run")
        return None

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        return LoadPlan([item for p in self.targets.values()
                         for item in create_read_items_for_chunk_list(p.key, saved[p.key], [_chunk(p)])])

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        return new_plan

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"{self.where}: unexpected non-tensor entry {read_item.dest_index.fqn!r}")

    def resolve_tensor(self, read_item):
        t = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))].tensor
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item, tensor) -> None:
        pass


_DCP_MODULE = "torch.distributed.checkpoint"
_TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` index building only DCP's metadata classes, torch.Size and dtypes,
    never an arbitrary object."""

    def find_class(self, module: str, name: str):
        if module == _DCP_MODULE or module.startswith(_DCP_MODULE + "."):
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, _TORCH_TYPES):
                return obj
        if module == "torch.serialization" and name == "_get_layout":  # a layout from its name
            return super().find_class(module, name)
        if (module, name) in (("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                              ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError) as e:
            raise CheckpointError(f"cannot read {path} ({e.__class__.__name__}: {str(e)[:120]})") from None
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


# ----------------------------------------------------------------------------------------------
# Directory layout, manifest, integrity
# ----------------------------------------------------------------------------------------------

def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _partial_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f".iter_{iteration:07d}.partial"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` under a temporary name, flush it to disk, then rename it over ``path``."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _crc32(path: Path, block: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "crc32": _crc32(path)}


def _manifest_crc(files: dict) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True).encode())


def latest_iteration(root: str | Path) -> Optional[int]:
    """The iteration named by the latest marker, or None when there is none."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{marker} does not hold an iteration number (found {text[:40]!r})") from None


def complete_iterations(root: str | Path) -> list[int]:
    """Iterations under ``root`` that have a finished checkpoint directory (with its manifest), newest first."""
    out = []
    for d in Path(root).glob("iter_*"):
        if d.is_dir() and (d / MANIFEST).is_file():
            try:
                out.append(int(d.name[5:]))
            except ValueError:
                pass
    return sorted(out, reverse=True)


def _read_manifest(d: Path) -> dict:
    path = d / MANIFEST
    try:
        man = json.loads(path.read_text())
        files = man["files"]
        ok = man.get("crc32") == _manifest_crc(files)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint {d} is incomplete") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is corrupted ({e.__class__.__name__})") from None
    if not ok:
        raise CheckpointError(f"{path} is corrupted (its checksum does not match)")
    return man


def verify_files(d: Path, names: list[str], files: dict) -> Optional[str]:
    """The first problem with the listed files of checkpoint ``d`` (one line naming the file), or None."""
    for name in names:
        path, want = d / name, files[name]
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{path} is truncated or damaged ({size} bytes, {want['size']} expected)"
        if _crc32(path) != want["crc32"]:
            return f"{path} is corrupted (CRC-32 mismatch)"
    return None


def verify_checkpoint(d: Path, group=None) -> None:
    """Raise :class:`CheckpointError` naming the file if any file of checkpoint ``d`` is missing,
    truncated or corrupted. With a process group the ranks share the reading."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if _distributed(group) else (0, 1)
    try:
        files = _read_manifest(d)["files"]
        problem = verify_files(d, sorted(files)[rank::world], files)
    except CheckpointError as e:
        problem = str(e)
    _raise_if_any(problem, group)


class _Solo:
    """``group=SOLO``: this process alone, even inside a distributed job."""


SOLO = _Solo()


def _distributed(group) -> bool:
    return group is not SOLO and dist.is_available() and dist.is_initialized()


def _pg(group):
    return None if group is SOLO else group


def read_common(d: Path) -> dict:
    path = d / COMMON
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupted ({e.__class__.__name__})") from None


def find_checkpoint(root: str | Path, group=None, warn: Callable[[str], None] = print,
                    iteration: Optional[int] = None) -> Optional[Path]:
    """The checkpoint directory to resume from: the latest one (or ``iteration``'s), verified. A
    damaged latest checkpoint is reported through ``warn`` and the previous complete one is used;
    an explicitly asked-for ``iteration`` that is damaged is an error. None: no checkpoint."""
    root = Path(root)
    wanted = latest_iteration(root) if iteration is None else iteration
    if wanted is not None and any(iter_dir(root, wanted).glob("rank_*.pt")):
        raise CheckpointError(f"{iter_dir(root, wanted)} is a per-rank checkpoint (rank_*.pt) of an older "
                              "paratron; this paratron reads only sharded checkpoints")
    if iteration is not None:
        d = iter_dir(root, iteration)
        if not d.is_dir():
            raise CheckpointError(f"{d} does not exist (asked for iteration {iteration})")
        verify_checkpoint(d, group)
        return d
    latest = latest_iteration(root)
    candidates = complete_iterations(root)
    if latest is None and not candidates:
        return None
    if latest is not None:  # the marker's iteration first, then older complete ones
        candidates = [latest] + [i for i in candidates if i < latest]
    first_problem = None
    for it in candidates:
        d = iter_dir(root, it)
        try:
            verify_checkpoint(d, group)
        except CheckpointError as e:
            first_problem = first_problem or str(e)
            warn(f" WARNING: {e}; trying the previous checkpoint")
            continue
        if it != candidates[0]:
            warn(f" WARNING: falling back to {d}")
        return d
    raise CheckpointError(f"no complete checkpoint under {root}: {first_problem}")


# ----------------------------------------------------------------------------------------------
# Save and load
# ----------------------------------------------------------------------------------------------

def _rank(group) -> int:
    return dist.get_rank(group) if _distributed(group) else 0


def _barrier(group) -> None:
    if _distributed(group):
        dist.barrier(group=group)


def _save_files(pieces: list[Piece], path: Path, common: dict, group) -> None:
    """DCP write of ``pieces`` into ``path`` (which exists); rank 0 also writes common.json."""
    if _rank(group) == 0:
        write_text_atomic(path / COMMON, json.dumps(common, indent=1, sort_keys=True))
    with _quiet(group):
        dcp.save({}, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True),
                 planner=_PieceSavePlanner(pieces), process_group=_pg(group), no_dist=not _distributed(group))


def _finish(root: Path, iteration: int, tmp: Path, group, keep_last: int) -> Path:
    """After every rank's chunks are written: checksums, manifest, rename, latest marker, retention."""
    rank = _rank(group)
    world = dist.get_world_size(group) if _distributed(group) else 1
    names = sorted(p.name for p in tmp.iterdir() if p.is_file())
    mine = {n: _file_entry(tmp / n) for n in names[rank::world]}
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=group)
    else:
        parts = [mine]
    final = iter_dir(root, iteration)
    if rank == 0:
        files = {k: v for part in parts for k, v in part.items()}
        manifest = {"format": FORMAT, "iteration": iteration, "files": files, "crc32": _manifest_crc(files)}
        write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        old = root / f".{final.name}.old"
        if final.exists():  # a checkpoint of the same iteration: replaced only now that the new one is complete
            os.replace(final, old)
        os.replace(tmp, final)
        write_text_atomic(root / LATEST, str(iteration))
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        if keep_last > 0:
            for it in complete_iterations(root)[keep_last:]:
                shutil.rmtree(iter_dir(root, it), ignore_errors=True)
    _barrier(group)
    return final


def _prepare(root: Path, iteration: int, group) -> Path:
    tmp = _partial_dir(root, iteration)
    if _rank(group) == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".iter_*.partial"):  # left by a crashed save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier(group)
    return tmp


def save(root: str | Path, iteration: int, pieces: list[Piece], common: dict, group=None, keep_last: int = 0) -> Path:
    """Save synchronously; every rank of ``group`` calls it with its own pieces. Returns the directory."""
    root = Path(root)
    tmp = _prepare(root, iteration, group)
    _save_files(pieces, tmp, dict(common, iteration=iteration), group)
    _barrier(group)
    return _finish(root, iteration, tmp, group, keep_last)


def stage_to_cpu(pieces: list[Piece], pinned: Optional[dict] = None) -> list[Piece]:
    """CPU copies of the pieces (into reused pinned buffers when ``pinned`` is a dict and CUDA is there)."""
    out = []
    cuda = any(p.tensor.is_cuda for p in pieces)
    for p in pieces:
        t = p.tensor
        if t.is_cuda and pinned is not None:
            k = (p.key, p.offsets)
            buf = pinned.get(k)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = pinned[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
        else:
            buf = t.detach().to("cpu", copy=True)
        out.append(Piece(p.key, p.shape, p.offsets, buf, p.vocab_rows))
    if cuda:
        torch.cuda.synchronize()
    return out


class AsyncSave:
    """A save running in a background thread: the pieces are first copied to CPU (training may then
    change the originals), the write, manifest, rename and latest marker follow in the thread, over
    ``group`` (a gloo group used by nothing else). ``wait()`` joins it and re-raises its error."""

    def __init__(self, root: str | Path, iteration: int, pieces: list[Piece], common: dict, group,
                 keep_last: int = 0, pinned: Optional[dict] = None, on_done: Optional[Callable[[Path, float], None]] = None):
        self.root, self.iteration = Path(root), iteration
        t0 = time.perf_counter()
        self.staged = stage_to_cpu(pieces, pinned)
        self.stage_seconds = time.perf_counter() - t0
        self.tmp = _prepare(self.root, iteration, group)
        self.error: Optional[BaseException] = None
        self.path: Optional[Path] = None
        self._args = (dict(common, iteration=iteration), group, keep_last, on_done)
        self.thread = threading.Thread(target=self._run, name=f"paratron-save-{iteration}", daemon=False)
        self.thread.start()

    def _run(self) -> None:
        common, group, keep_last, on_done = self._args
        t0 = time.perf_counter()
        try:
            _save_files(self.staged, self.tmp, common, group)
            _barrier(group)
            self.path = _finish(self.root, self.iteration, self.tmp, group, keep_last)
            if on_done is not None:
                on_done(self.path, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self.staged = []

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> Path:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.path


def load(d: Path, pieces: list[Piece], group=None) -> None:
    """Fill every piece's tensor from checkpoint directory ``d`` (already verified), whatever layout
    it was saved with. A missing tensor or another shape is a :class:`CheckpointError` on every rank
    before anything is read."""
    planner = _PieceLoadPlanner(pieces, str(d))
    reader = _SafeReader(str(d))
    planner.metadata = reader.read_metadata()
    _raise_if_any(planner.problem(), group)
    with _quiet(group):
        dcp.load({}, storage_reader=reader, planner=planner, process_group=_pg(group), no_dist=not _distributed(group))
    with torch.no_grad():
        for p in planner.targets.values():  # padded vocabulary rows the checkpoint does not have: zeros
            if p.vocab_rows:
                first_missing = planner.metadata.state_dict_metadata[p.key].size[0] - p.offsets[0]
                if first_missing < p.tensor.shape[0]:
                    p.tensor[max(first_missing, 0):].zero_()
        for src, dst in planner.copies:
            dst.copy_(src)


def _raise_if_any(problem: Optional[str], group) -> None:
    """Raise the first rank's problem on every rank (so no rank goes on into a collective alone)."""
    if _distributed(group) and dist.get_world_size(group) > 1:
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
        problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)


@contextlib.contextmanager
def _quiet(group):
    """DCP warns when it runs in a single process; here that is what was asked for."""
    with warnings.catch_warnings():
        if not _distributed(group):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def tensor_shapes(d: Path) -> dict[str, tuple[tuple, torch.dtype]]:
    """{key: (global shape, dtype)} of every tensor in checkpoint directory ``d``."""
    md = _SafeReader(str(d)).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def load_full(d: Path, keys: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
    """Whole tensors (CPU) of checkpoint ``d`` read by this process alone (conversion); all keys by default."""
    shapes = tensor_shapes(d)
    keys = list(shapes) if keys is None else keys
    missing = [k for k in keys if k not in shapes]
    if missing:
        raise CheckpointError(f"{d} has no tensor {missing[0]!r}")
    out = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in keys}
    load(d, [Piece(k, tuple(t.shape), (0,) * t.dim(), t) for k, t in out.items()], group=SOLO)
    return out


def save_full(root: str | Path, iteration: int, tensors: dict[str, torch.Tensor], common: dict) -> Path:
    """Write whole tensors as a one-rank checkpoint from this process alone (conversion)."""
    pieces = [Piece(k, tuple(t.shape), (0,) * t.dim(), t) for k, t in tensors.items()]
    return save(root, iteration, pieces, common, group=SOLO)

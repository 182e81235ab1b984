"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), in Megatron's layout:

    {root}/latest_checkpointed_iteration.txt     the newest complete iteration, replaced atomically
    {root}/iter_0000100/.metadata                DCP's index of every tensor chunk
    {root}/iter_0000100/__{rank}_{n}.distcp      the chunks each rank wrote
    {root}/iter_0000100/common.json              iteration, samples, scheduler, config, ... (rank 0)
    {root}/iter_0000100/metadata.json            written last: size and CRC-32 of every file above

Every tensor is stored as a *global* tensor (the shape it has in the one-rank model) under a name
that does not depend on the layout; each rank contributes the rectangular chunks it holds, with
their offsets in the global tensor (a ``Piece``). Chunks held by several ranks (data-parallel
replicas, TP-replicated norms) are written once. Loading asks DCP for the chunks this rank needs in
*its* layout, and DCP reads whichever saved chunks overlap them: that is the resharding, for
tensor, pipeline and data parallelism and for the distributed optimizer's flat shards alike
(paratron/checkpoint/pieces.py cuts a flat range of a parameter into rectangles of the global tensor).

A save goes to ``.iter_0000100.partial/``; when every rank's chunks and DCP's ``.metadata`` are
written, rank 0 writes ``metadata.json`` (file sizes and checksums), renames the directory to
``iter_0000100`` and only then replaces the latest marker, so a crash at any point leaves the
previous checkpoint as latest. :class:`AsyncSave` runs the same steps in a background thread on
CPU copies of the tensors, over a separate group (gloo, or NCCL with --disable-gloo-process-groups) so it never
interleaves with training's collectives. Loading checks sizes and checksums first; a damaged checkpoint is named
in the error, and :func:`find_checkpoint` falls back to the previous complete one.

Nothing is unpickled from disk except DCP's ``.metadata`` index, and that through an unpickler that
only builds DCP's own metadata classes (paratron/checkpoint/pieces.py); tensors are read with
``weights_only=True`` and everything else is JSON.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import os_error_reason
from .pieces import CheckpointError, Piece, PieceLoadPlanner, PieceSavePlanner, SafeReader
from .retention import Retention

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
MANIFEST = "metadata.json"
FORMAT = "paratron-torch_dist-1"


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
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    from .megatron import refuse_megatron  # (Megatron writes the same tracker file; its directories are not ours)
    refuse_megatron(root, iteration)
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
        from .torchtitan import refuse_torchtitan  # (its step-N directories: converted first)
        refuse_torchtitan(root)
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


def _write(root: Path, iteration: int, tmp: Path, pieces: list[Piece], common: dict, group, keep_last: int) -> Path:
    """Everything after :func:`_prepare`: rank 0 writes common.json, every rank its chunks (DCP), then
    :func:`_finish` publishes the checkpoint. Returns its directory. A failure on any rank is a
    CheckpointError on every rank naming the cause (a full disk as such), after the partial
    directory is removed; the previous checkpoint and the latest marker are untouched."""
    try:
        problem = None
        if _rank(group) == 0:
            try:
                write_text_atomic(tmp / COMMON, json.dumps(dict(common, iteration=iteration), indent=1, sort_keys=True))
            except OSError as e:
                problem = f"cannot write {tmp / COMMON}: {os_error_reason(e)}"
        _raise_if_any(problem, group)
        with _quiet(group):
            dcp.save({}, storage_writer=dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True),
                     planner=PieceSavePlanner(pieces), process_group=_pg(group), no_dist=not _distributed(group))
        _barrier(group)
        return _finish(root, iteration, tmp, group, keep_last)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise _save_failed(e, root, iteration, tmp, group) from None


LOW_SPACE = 64 << 20  # bytes: less free space than this after a failed write means the disk filled up


def _root_cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (else ``e``)."""
    if isinstance(e, CheckpointException) and e.failures:
        first = e.failures[min(e.failures)]
        return first[0] if isinstance(first, tuple) else first
    return e


def _save_failed(e: BaseException, root: Path, iteration: int, tmp: Path, group) -> CheckpointError:
    """The one-line error of a failed save; removes the partial directory (rank 0)."""
    cause = _root_cause(e)
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if isinstance(cause, OSError):
        reason = os_error_reason(cause)
    elif isinstance(cause, CheckpointError):
        reason = str(cause)
    else:  # e.g. torch.save's "unexpected pos 704 vs 598" when a write came up short
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[-1][:200]
        reason = (f"the disk is full ({free} bytes free; the write failed with: {first})"
                  if free is not None and free < LOW_SPACE else f"{type(cause).__name__}: {first}")
    if _rank(group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        latest = latest_iteration(root)
    except CheckpointError:
        latest = None
    kept = (f"the previous checkpoint (iteration {latest}) is intact" if latest is not None
            else "there is no earlier checkpoint")
    return CheckpointError(f"saving iteration {iteration} to {root} failed: {reason}; its partial directory was "
                           f"removed and {kept}")


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
    final, problem = iter_dir(root, iteration), None
    if rank == 0:
        try:
            _publish(root, iteration, tmp, final, parts, keep_last)
        except OSError as e:
            problem = f"cannot publish {final}: {os_error_reason(e)}"
    _raise_if_any(problem, group)  # (a barrier too: every rank returns once rank 0 has published)
    return final


def _publish(root: Path, iteration: int, tmp: Path, final: Path, parts: list, keep_last) -> None:
    """Rank 0: manifest, rename, latest marker, retention."""
    files = {k: v for part in parts for k, v in part.items()}
    manifest = {"format": FORMAT, "iteration": iteration, "files": files, "crc32": _manifest_crc(files)}
    write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    old = root / f".{final.name}.old"
    if final.exists():  # a checkpoint of the same iteration: replaced only now that the new one is complete
        os.replace(final, old)
    previous = _previous_latest(root)
    os.replace(tmp, final)
    write_text_atomic(root / LATEST, str(iteration))
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    Retention.of(keep_last).prune(root, iter_dir, complete_iterations(root), iteration, previous)


def _previous_latest(root: Path) -> Optional[int]:
    try:
        return latest_iteration(root)
    except CheckpointError:  # an unreadable marker: --save-retain-interval deletes nothing
        return None


def _prepare(root: Path, iteration: int, group) -> Path:
    """Rank 0 makes the partial directory; every rank must see it (one filesystem shared by all)."""
    tmp, problem = _partial_dir(root, iteration), None
    if _rank(group) == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".iter_*.partial"):  # left by a crashed save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            problem = f"saving iteration {iteration} to {root} failed: cannot create {tmp}: {os_error_reason(e)}"
    _barrier(group)
    if problem is None and not tmp.is_dir():
        problem = (f"rank {_rank(group)} does not see {tmp}, made by rank 0: --save must be a directory that every "
                   "rank shares (a network filesystem on several nodes)")
    _raise_if_any(problem, group)
    return tmp


def save(root: str | Path, iteration: int, pieces: list[Piece], common: dict, group=None, keep_last: int = 0) -> Path:
    """Save synchronously; every rank of ``group`` calls it with its own pieces. Returns the directory."""
    root = Path(root)
    return _write(root, iteration, _prepare(root, iteration, group), pieces, common, group, keep_last)


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
    ``group`` (a group used by nothing else; on NCCL the thread works on the caller's CUDA device, where the
    group's object collectives stage their bytes). ``wait()`` joins it and re-raises its error."""

    def __init__(self, root: str | Path, iteration: int, pieces: list[Piece], common: dict, group,
                 keep_last: int = 0, pinned: Optional[dict] = None, on_done: Optional[Callable[[Path, float], None]] = None):
        self.root, self.iteration = Path(root), iteration
        t0 = time.perf_counter()
        self.staged = stage_to_cpu(pieces, pinned)
        self.stage_seconds = time.perf_counter() - t0
        self.tmp = _prepare(self.root, iteration, group)
        self.error: Optional[BaseException] = None
        self.path: Optional[Path] = None
        self._args = (common, group, keep_last, on_done)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.thread = threading.Thread(target=self._run, name=f"paratron-save-{iteration}", daemon=False)
        self.thread.start()

    def _run(self) -> None:
        common, group, keep_last, on_done = self._args
        t0 = time.perf_counter()
        try:
            if self.device is not None:  # (a new thread starts on device 0)
                torch.cuda.set_device(self.device)
            self.path = _write(self.root, self.iteration, self.tmp, self.staged, common, group, keep_last)
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
    planner = PieceLoadPlanner(pieces, str(d))
    reader = SafeReader(str(d))
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
    md = SafeReader(str(d)).read_metadata()
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

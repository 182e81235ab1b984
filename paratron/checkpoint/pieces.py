"""The pieces of a sharded checkpoint and the DCP planners that write and read them.

A :class:`Piece` is one rectangular chunk of a *global* tensor (the shape the tensor has in the
one-rank model) that this rank holds: its name, the global shape, its offsets there, and a view of
the local storage. :func:`flat_pieces` cuts a rank's part of a parameter (laid out by its ShardSpec), or a flat
range of one (the distributed optimizer's shard), into such rectangles. The planners hand DCP exactly these chunks:
on save each distinct chunk is written once; on load DCP reads whichever saved chunks overlap the
chunks asked for, which is how a checkpoint reshards. :class:`SafeReader` reads DCP's pickled
index with an unpickler that builds only DCP's metadata classes.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, SavePlan, SavePlanner, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import UserError
from ..parallel.sharding import REPLICATED, ShardSpec, flat_rectangles, global_rectangles



class CheckpointError(UserError, RuntimeError):
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


def flat_pieces(key: str, flat: torch.Tensor, local_shape: tuple, lo: int, spec: ShardSpec = REPLICATED,
                coords: Optional[dict] = None) -> list[Piece]:
    """The pieces of ``flat`` = elements [lo, lo + flat.numel()) of this rank's part (shape
    ``local_shape``) of a global tensor laid out by ``spec`` (paratron/parallel/sharding.py);
    ``coords`` = {group: (rank, size)} of this rank in the groups the spec splits over. Any number
    of dimensions, any number of them split, blocks of any sizes."""
    local_shape, coords = tuple(local_shape), coords or {}
    shape = spec.global_shape(local_shape)
    out = []
    for offsets, sizes, start in flat_rectangles(local_shape, lo, lo + flat.numel()):
        view = flat[start - lo: start - lo + int(torch.Size(sizes).numel())].view(sizes)
        for local_off, global_off, n in global_rectangles(spec, coords, offsets, sizes):
            part = view
            for d, (a, b, k) in enumerate(zip(local_off, offsets, n)):
                if k != sizes[d]:
                    part = part.narrow(d, a - b, k)
            out.append(Piece(key, shape, global_off, part, spec.vocab_rows))
    return out


def tensor_pieces(key: str, t: torch.Tensor, spec: ShardSpec = REPLICATED, coords: Optional[dict] = None) -> list[Piece]:
    """The pieces of a whole local tensor ``t`` (see :func:`flat_pieces`)."""
    if t.dim() == 0:
        return [Piece(key, (), (), t)]
    return flat_pieces(key, t.view(-1), tuple(t.shape), 0, spec, coords)


def replicated_row(key: str, t: torch.Tensor, row: int, rows: int) -> Piece:
    """Row ``row`` of a [rows, n] global tensor: a per-rank value (an RNG state)."""
    t = t.reshape(1, -1)
    return Piece(key, (rows, t.shape[1]), (row, 0), t)


# ----------------------------------------------------------------------------------------------
# DCP planners over pieces
# ----------------------------------------------------------------------------------------------

def _chunk(p: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.size())


class PieceSavePlanner(SavePlanner):
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


class PieceLoadPlanner(LoadPlanner):
    """Reads the saved chunks that overlap each requested piece into the piece's tensor."""

    def __init__(self, pieces: list[Piece], where: str):
        self.where = where
        # The same chunk may be wanted twice on a rank (a bf16 weight and its fp32 master from an fp32
        # checkpoint): the widest dtype is read from storage and the others are copied from it.
        wanted: dict = {}
        for p in pieces:
            wanted.setdefault((p.key, tuple(p.offsets)), []).append(p)
        self.targets: dict = {}
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, ps in wanted.items():
            ps.sort(key=lambda p: -p.tensor.element_size())
            self.targets[k] = ps[0]
            self.copies += [(ps[0].tensor, p.tensor) for p in ps[1:]]

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


class SafeReader(dcp.FileSystemReader):
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


class _RawBytes(DefaultLoadPlanner):
    """DCP's loader of byte objects, kept as bytes (its default unpickles them with weights_only=False)."""

    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn] = value.read()


def read_objects(d: Path, names: list[str]) -> dict:
    """The byte objects (a DCP checkpoint's non-tensor entries) ``names`` of directory ``d``, each read by torch's
    weights-only loader: {name: object}, None for one that names classes that loader does not build."""
    import io
    import warnings
    if not names:
        return {}
    raw = {k: io.BytesIO() for k in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(raw, storage_reader=SafeReader(str(d)), planner=_RawBytes(), no_dist=True)
    out = {}
    for k, v in raw.items():
        try:
            out[k] = torch.load(io.BytesIO(v), weights_only=True)
        except Exception:  # noqa: BLE001 (a class the safe loader refuses: the caller decides)
            out[k] = None
    return out

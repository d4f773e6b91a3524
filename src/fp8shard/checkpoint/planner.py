"""The DCP side: per-rank pieces of flattened tensors, and a metadata reader that runs no code.

[Note: flat pieces]
    The optimizer's FP32 master and Adam states are saved per parameter as 1-D tensors of the
    parameter's ``numel`` ([Note: checkpoint space]). Rank r holds an irregular set of pieces of
    each of them ([Note: shard layout]: a parameter may straddle shards and buckets, so one rank
    can own several pieces, or none). DCP describes a saved tensor as a list of chunks
    (offset, size) in its global shape, so each piece is one chunk: the save planner adds one
    ``WriteItem`` per piece and hands DCP the piece's tensor; the load planner asks DCP for the
    chunks the *loading* ranks own (``create_read_items_for_chunk_list`` computes the overlaps
    with the saved chunks), so a checkpoint written by N ranks loads on M.

    Why not ``ShardedTensor``: it works on gloo with torch 2.13 but is deprecated (every use
    warns "Please use DTensor instead"), and DTensor cannot describe several uneven pieces per
    rank. A custom planner uses only the documented planner interface (``WriteItem``,
    ``ReadItem``, ``create_read_items_for_chunk_list``), which DCP itself is built on.

[Note: safe metadata]
    ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``, which can run
    any code a crafted file names. ``SafeFileSystemReader`` unpickles it with an allow-list of
    DCP's own metadata classes, ``torch.Size``, dtypes and paths; anything else is refused with
    an error naming it. Tensor data is read by DCP with ``torch.load(weights_only=True)``. We never
    save non-tensor values through DCP (DCP would load those with ``weights_only=False``), and the
    load planner refuses any byte item.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    Metadata,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fp8shard.checkpoint.errors import CheckpointFormatError


@dataclasses.dataclass
class FlatPieces:
    """Pieces of one 1-D tensor of ``numel`` elements that this rank saves or loads.

    ``pieces`` maps the offset in the flattened tensor to a 1-D tensor of that piece's values.
    May be empty (this rank owns nothing of the tensor). See [Note: flat pieces].
    """

    numel: int
    pieces: dict[int, torch.Tensor]


def _chunk(offset: int, numel: int) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([numel]))


class PiecesSavePlanner(DefaultSavePlanner):
    """Plain tensors as DCP saves them (replicated keys written once); ``FlatPieces`` as chunks."""

    def __init__(self, flat: dict[str, FlatPieces]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.flat = flat

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for fqn, fp in self.flat.items():
            for off, t in fp.pieces.items():
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size([off])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=_chunk(off, t.numel()),
                                                properties=TensorProperties.create_from_tensor(t),
                                                size=torch.Size([fp.numel])),
                ))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fp = self.flat.get(write_item.index.fqn)
        if fp is None:
            return super().resolve_data(write_item)
        assert write_item.index.offset is not None
        return fp.pieces[write_item.index.offset[0]].detach()


class PiecesLoadPlanner(DefaultLoadPlanner):
    """Loads plain tensors by key and ``FlatPieces`` by chunk; refuses pickled (byte) items."""

    def __init__(self, flat: dict[str, FlatPieces]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.flat = flat

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        items = list(plan.items)
        for fqn, fp in self.flat.items():
            if not fp.pieces:
                continue
            offsets = sorted(fp.pieces)
            chunks = [_chunk(off, fp.pieces[off].numel()) for off in offsets]
            md = self.metadata.state_dict_metadata[fqn]
            items += create_read_items_for_chunk_list(fqn, md, chunks)  # type: ignore[arg-type]
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        fp = self.flat.get(index.fqn)
        if fp is None:
            return super().lookup_tensor(index)
        assert index.offset is not None
        return fp.pieces[index.offset[0]]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointFormatError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; fp8shard checkpoints "
            "hold tensors only, and loading pickles could run code from the file: refused")


# ---------------------------------------------------------------------------- safe metadata
_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


def _dcp_enum_member(cls: Any, name: Any) -> Any:
    """``builtins.getattr`` as DCP's metadata uses it: some Pythons (3.11.2 does, 3.11.7 does not)
    pickle an ``Enum`` member as ``getattr(EnumClass, name)``. Only a member of one of DCP's
    metadata enums is handed out; any other use of ``getattr`` is refused."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == _DCP_MD
            and isinstance(name, str) and name in cls.__members__):
        return cls[name]
    raise CheckpointFormatError(
        f"the checkpoint's DCP .metadata calls getattr({getattr(cls, '__name__', type(cls).__name__)}, "
        f"{name!r}), which is not a DCP metadata enum member; refusing to unpickle it (it could run code)")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else; see [Note: safe metadata]."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _dcp_enum_member
        if module == _DCP_MD or (module, name) in _ALLOWED:
            obj = super().find_class(module, name)
            if module != "pathlib" or issubclass(obj, pathlib.PurePath):
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint._extension") and name.endswith("Descriptor"):
            return super().find_class(module, name)
        raise CheckpointFormatError(
            f"the checkpoint's DCP .metadata refers to {module}.{name}, which DCP metadata never "
            "contains; refusing to unpickle it (it could run code)")


def read_dcp_metadata(path: str | pathlib.Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint directory ``path``, unpickled safely."""
    md_file = pathlib.Path(path) / ".metadata"
    try:
        with open(md_file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointFormatError(f"{md_file} is missing: not a complete DCP checkpoint") from None
    except CheckpointFormatError:
        raise
    except Exception as e:
        raise CheckpointFormatError(f"{md_file} is damaged (cannot be read: {type(e).__name__}: "
                                    f"{e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f"{md_file} holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with an allow-list ([Note: safe metadata])."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointFormatError("per-rank DCP metadata files are not used by fp8shard checkpoints")
        md = read_dcp_metadata(self.path)
        # What FileSystemReader.read_metadata adds after unpickling.
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            md.storage_meta.load_id = self.load_id
        return md

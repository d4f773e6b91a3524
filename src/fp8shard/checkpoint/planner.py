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
    ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``, which runs
    whatever callable a crafted file names. ``read_dcp_metadata`` unpickles it instead with the
    pure-Python unpickler under four rules:

      - a global is looked up in ``_GLOBALS`` by its exact (module, name) pair and nowhere else:
        DCP's metadata records and ``_MEM_FORMAT_ENCODING``, ``filesystem._StorageInfo``,
        ``torch.Size``, ``torch.<dtype>`` for the dtypes of ``state.DTYPES``, and stand-ins for
        ``torch.serialization._get_layout`` (known layout names only), ``builtins.getattr``
        (members of DCP's enum only) and the ``pathlib`` path classes (pure paths, which touch no
        file). Nothing is imported and no attribute is walked, so a dotted name never resolves;
      - REDUCE calls only ``torch.Size``, the enum, a pure path class or a stand-in, each with the
        argument types DCP gives it; NEWOBJ creates only the metadata records, without arguments;
      - BUILD fills only an instance of a metadata record (never a class, a function or a
        dtype), and only with that dataclass's own fields (TensorProperties: its ``__setstate__``);
      - INST, OBJ, NEWOBJ_EX, EXT1/2/4 and PERSID/BINPERSID are refused outright.

    The result is then checked field by field (``_check_metadata``): each entry is tensor
    metadata of a known dtype whose chunks lie inside it and cover it, each chunk is stored in a
    regular file directly in the checkpoint directory, within that file and in at least as many
    bytes as the chunk holds, nothing is compressed, and all tensors together declare no more
    bytes than the data files hold; ``io`` adds that each such file is listed (and hashed) in
    the manifest. Whatever breaks a rule raises one ``CheckpointFormatError`` naming it.
    Tensor data is read by DCP with ``torch.load(weights_only=True)``. We never save non-tensor
    values through DCP (DCP would load those with ``weights_only=False``), and the load planner
    refuses any byte item. docs/reliability.md, "Threat model: hostile checkpoints".
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import stat
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    Metadata,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
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
from fp8shard.checkpoint.state import DTYPES


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

# What BUILD may fill in: DCP's metadata records (dataclasses), exactly these types, and only
# their declared fields (or, for TensorProperties, through its own __setstate__).
_RECORDS: tuple[type, ...] = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                              TensorProperties, MetadataIndex, StorageMeta, _StorageInfo)
_FIELDS: dict[type, frozenset[str]] = {c: frozenset(f.name for f in dataclasses.fields(c)) for c in _RECORDS}
_OWN_SETSTATE = tuple(c for c in _RECORDS if "__setstate__" in vars(c))

_LAYOUT_NAMES = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "jagged")
_LAYOUTS: dict[str, torch.layout] = {
    str(v): v for n in _LAYOUT_NAMES if isinstance(v := getattr(torch, n, None), torch.layout)
}


def _refused(what: str) -> CheckpointFormatError:
    """The error for a pickle that breaks a rule; ``read_dcp_metadata`` puts the file's path before it."""
    what = "".join(c if c.isprintable() else repr(c)[1:-1] for c in what)  # one line, whatever it names
    return CheckpointFormatError(f"{what}; refused: fp8shard unpickles nothing but DCP's own metadata "
                                 "records (anything else could run code)")


def _layout(name: Any) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``, which DCP's pickles name for a
    ``torch.layout``: maps the known layout names and nothing else."""
    if isinstance(name, str) and name in _LAYOUTS:
        return _LAYOUTS[name]
    raise _refused(f"names the tensor layout {str(name)[:80]!r}, which is not a torch layout")


def _dcp_enum_member(cls: Any, name: Any) -> Any:
    """Stands in for ``builtins.getattr``, which some Pythons (3.11.2 does, 3.11.7 does not; 3.12
    does) use to pickle an ``Enum`` member: ``getattr(EnumClass, name)``. Only a member of DCP's
    one metadata enum is handed out."""
    if cls is _MEM_FORMAT_ENCODING and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    target = getattr(cls, "__name__", type(cls).__name__)
    raise _refused(f"calls getattr({target}, {str(name)[:80]!r}), which is not a member of DCP's "
                   "_MEM_FORMAT_ENCODING enum")


# Every global DCP's .metadata may name, by exact (module, name) -> the object it stands for.
# Looked up in this table only: no import, no attribute walk, so no dotted names. Paths (the
# checkpoint directory in StorageMeta) become pure paths, which cannot touch the file system.
_GLOBALS: dict[tuple[str, str], Any] = {
    **{(_DCP_MD, c.__name__): c for c in (Metadata, TensorStorageMetadata, BytesStorageMetadata,
                                          ChunkStorageMetadata, TensorProperties, MetadataIndex,
                                          StorageMeta, _MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    **{("torch", n): dt for n, dt in DTYPES.items()},
    ("torch.serialization", "_get_layout"): _layout,
    ("builtins", "getattr"): _dcp_enum_member,
    **{(m, n): pathlib.PurePosixPath for m in ("pathlib", "pathlib._local")
       for n in ("PosixPath", "PurePosixPath")},
    **{(m, n): pathlib.PureWindowsPath for m in ("pathlib", "pathlib._local")
       for n in ("WindowsPath", "PureWindowsPath")},
}
_OPCODES_REFUSED = {op[0]: name for op, name in (
    (pickle.INST, "INST"), (pickle.OBJ, "OBJ"), (pickle.EXT1, "EXT1"), (pickle.EXT2, "EXT2"),
    (pickle.EXT4, "EXT4"), (pickle.PERSID, "PERSID"), (pickle.BINPERSID, "BINPERSID"),
    (pickle.NEWOBJ_EX, "NEWOBJ_EX"))}


def _reduce_ok(func: Any, args: tuple) -> bool:
    """Whether REDUCE may call ``func(*args)``: only these callables, each with the arguments DCP
    gives it (each is harmless for any argument, the checks keep the failures plain)."""
    if func is torch.Size:
        return len(args) == 1 and type(args[0]) in (tuple, list) and all(type(x) is int for x in args[0])
    if func is _MEM_FORMAT_ENCODING:
        return len(args) == 1 and type(args[0]) is int
    if func is pathlib.PurePosixPath or func is pathlib.PureWindowsPath:
        return all(type(a) is str for a in args)
    return (func is _layout and len(args) == 1) or (func is _dcp_enum_member and len(args) == 2)


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else; see [Note: safe metadata].

    The pure-Python unpickler, so that REDUCE, NEWOBJ and BUILD can be checked one by one (the C
    one only lets ``find_class`` be replaced): about 1.3 MB of metadata a second, against 2 MB/s
    for the C one (most of the time goes to the records' constructors either way)."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        obj = _GLOBALS.get((module, name)) if type(module) is str and type(name) is str else None
        if obj is None:
            raise _refused(f"refers to {str(module)[:120]}.{str(name)[:120]}, which is not on the "
                           "allow-list of DCP metadata globals")
        return obj

    def _reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if type(args) is not tuple or not _reduce_ok(func, args):
            raise _refused(f"calls {_describe(func)} with {_describe_args(args)}, which DCP never does")
        self.stack[-1] = func(*args)

    def _newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not any(cls is c for c in _RECORDS) or type(args) is not tuple or args:
            raise _refused(f"creates {_describe(cls)} with {_describe_args(args)}, which DCP never does")
        self.append(cls.__new__(cls))

    def _build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if not any(cls is c for c in _RECORDS):
            raise _refused(f"sets the state of {_describe(inst)}, which is not a DCP metadata record")
        if cls in _OWN_SETSTATE:
            if type(state) is not tuple:
                raise _refused(f"gives {cls.__name__} a state of type {type(state).__name__}")
            inst.__setstate__(state)
            return
        if type(state) is tuple and len(state) == 2 and state[1] is None:
            state = state[0]
        if type(state) is not dict or not all(type(k) is str and k in _FIELDS[cls] for k in state):
            keys = list(state)[:5] if type(state) is dict else type(state).__name__
            raise _refused(f"sets {keys!r} of a {cls.__name__}, which are not all its fields")
        inst.__dict__.update(state)


def _opcode_refuser(name: str) -> Any:
    def refuse(self: _MetadataUnpickler) -> None:
        raise _refused(f"uses the pickle opcode {name}, which DCP never writes")
    return refuse


_MetadataUnpickler.dispatch[pickle.REDUCE[0]] = _MetadataUnpickler._reduce
_MetadataUnpickler.dispatch[pickle.NEWOBJ[0]] = _MetadataUnpickler._newobj
_MetadataUnpickler.dispatch[pickle.BUILD[0]] = _MetadataUnpickler._build
for _code, _name in _OPCODES_REFUSED.items():
    _MetadataUnpickler.dispatch[_code] = _opcode_refuser(_name)


def _describe(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return f"a {type(obj).__name__}"


def _describe_args(args: Any) -> str:
    if type(args) is not tuple:
        return f"arguments of type {type(args).__name__}"
    return f"({', '.join(type(a).__name__ for a in args[:6])}{', ...' if len(args) > 6 else ''})"


# ---------------------------------------------------------------------------- reading and checking it
def is_plain_name(name: Any) -> bool:
    """A file name directly inside the checkpoint directory: no separator, no ``..``, no NUL."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..")
            and not any(c in name for c in "/\\\0"))


def regular_file_size(path: pathlib.Path) -> int:
    """The size of ``path`` (symlinks followed), refusing anything but a regular file: opening a
    FIFO would block and a device could be endless."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path} is missing: the checkpoint is damaged") from None
    except OSError as e:
        raise CheckpointFormatError(f"{path} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointFormatError(f"{path} is not a regular file: refused")
    return st.st_size


def _numel(size: torch.Size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def _check_metadata(md: Any, directory: pathlib.Path) -> None:
    """The unpickled records hold what DCP would write, and every tensor they declare is backed by
    bytes in the checkpoint's own files: a load allocates no more than the files hold.

    Checked: the types of every field DCP reads; chunks inside their tensor and covering it;
    each chunk stored, in a plain file of this directory, within that file, with at least the
    chunk's bytes; no stream transforms (fp8shard never compresses); and all tensors together
    no larger than the files they are stored in."""
    md_file = directory / ".metadata"

    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{md_file} is damaged or forged: {what}")

    if type(md) is not Metadata:
        raise bad(f"it holds a {type(md).__name__}, not DCP Metadata")
    if type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        raise bad("state_dict_metadata and storage_data must be dicts")
    if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta:
        raise bad("storage_meta is not a StorageMeta")
    if md.version is not None and type(md.version) is not str:
        raise bad("version is not a string")
    file_sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        if (type(index) is not MetadataIndex or type(info) is not _StorageInfo or type(index.fqn) is not str
                or (index.offset is not None and type(index.offset) is not torch.Size)):
            raise bad("storage_data must map MetadataIndex (a name, an offset) to _StorageInfo")
        name = info.relative_path
        if not is_plain_name(name):
            raise bad(f"entry {index.fqn!r} is stored in {str(name)[:120]!r}, which is not a file of the "
                      "checkpoint directory")
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0
                and info.length >= 0):
            raise bad(f"entry {index.fqn!r} has a stored offset or length that is not an integer >= 0")
        if getattr(info, "transform_descriptors", None):
            raise bad(f"entry {index.fqn!r} is stored through transforms "
                      f"{list(info.transform_descriptors)[:4]!r}; fp8shard writes none")
        if name not in file_sizes:
            file_sizes[name] = regular_file_size(directory / name)
        if info.offset + info.length > file_sizes[name]:
            raise bad(f"entry {index.fqn!r} is stored at bytes {info.offset}..{info.offset + info.length} "
                      f"of {name}, which has {file_sizes[name]}")
    declared = 0
    for fqn, m in md.state_dict_metadata.items():
        if type(fqn) is not str:
            raise bad("an entry's key is not a string")
        if type(m) is BytesStorageMetadata:
            continue  # never read: the load planner refuses byte items
        if type(m) is not TensorStorageMetadata or type(m.properties) is not TensorProperties:
            raise bad(f"entry {fqn!r} is a {type(m).__name__}, not tensor metadata")
        dtype, size = m.properties.dtype, m.size
        if not any(dtype is dt for dt in DTYPES.values()):
            raise bad(f"entry {fqn!r} has dtype {dtype!r}, not a tensor dtype")
        if type(size) is not torch.Size or any(d < 0 for d in size) or type(m.chunks) is not list:
            raise bad(f"entry {fqn!r} has a size that is not a torch.Size of sizes >= 0")
        covered = 0
        for ch in m.chunks:
            if (type(ch) is not ChunkStorageMetadata or type(ch.offsets) is not torch.Size
                    or type(ch.sizes) is not torch.Size or not len(ch.offsets) == len(ch.sizes) == len(size)
                    or any(o < 0 or s < 0 or o + s > d
                           for o, s, d in zip(ch.offsets, ch.sizes, size, strict=True))):
                raise bad(f"entry {fqn!r} has a chunk outside its size {tuple(size)}")
            info = md.storage_data.get(MetadataIndex(fqn, ch.offsets))
            nbytes = _numel(ch.sizes) * dtype.itemsize
            if info is None:
                raise bad(f"a chunk of entry {fqn!r} (at {tuple(ch.offsets)}) is stored nowhere")
            if nbytes > info.length:
                raise bad(f"a chunk of entry {fqn!r} declares {nbytes} bytes but is stored in {info.length}")
            covered += _numel(ch.sizes)
        if covered < _numel(size):
            raise bad(f"entry {fqn!r} has size {tuple(size)} but its chunks hold only {covered} elements")
        declared += _numel(size) * dtype.itemsize
    held = sum(file_sizes.values())
    if declared > held:
        raise bad(f"its tensors declare {declared} bytes, more than the {held} bytes of its data files")


def read_dcp_metadata(path: str | pathlib.Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint directory ``path``, unpickled safely and checked
    against the files beside it ([Note: safe metadata])."""
    directory = pathlib.Path(path)
    md_file = directory / ".metadata"
    regular_file_size(md_file)
    try:
        with open(md_file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{md_file} {e}") from None
    except Exception as e:  # whatever a damaged pickle raises, RecursionError included
        raise CheckpointFormatError(f"{md_file} is damaged (cannot be read: {type(e).__name__}: "
                                    f"{str(e)[:200]})") from None
    _check_metadata(md, directory)
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

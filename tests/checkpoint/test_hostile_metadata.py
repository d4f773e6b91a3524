"""Hostile DCP ``.metadata`` files: every one is refused with one line, and none runs anything.

Each case builds a crafted pickle (by hand, opcode by opcode, or with a small ``__reduce__``
class) whose payload, if it ever ran, would create a marker file. The case is written into a
copy of a genuine checkpoint with its manifest re-hashed to match, as an attacker who can
write the checkpoint directory would, and loaded three ways: ``read_dcp_metadata``,
``load_checkpoint``, and the training command's ``trainer.resume=<path>``. Each must refuse
with one ``CheckpointFormatError`` line (exit status 2 for the command), create no marker,
leave the model unchanged, and leave the classes the unpickler may touch unchanged.
See [Note: safe metadata] and docs/reliability.md, "Threat model: hostile checkpoints".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import pickle
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from fp8shard.checkpoint import CheckpointFormatError, load_checkpoint, planner, save_checkpoint
from fp8shard.checkpoint.planner import read_dcp_metadata
from fp8shard.train.__main__ import main
from tests.checkpoint import cases
from tests.reliability.common import run_args, tree_digest


# ---------------------------------------------------------------------------- pickle by hand
def _s(text: str) -> bytes:
    raw = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _i(n: int) -> bytes:
    return pickle.BININT + struct.pack("<i", n)


def _g(module: str, name: str) -> bytes:
    """A global, as protocol 4 names one (STACK_GLOBAL)."""
    return _s(module) + _s(name) + pickle.STACK_GLOBAL


def _old_g(module: str, name: str) -> bytes:
    """A global, as protocols 0-3 name one (GLOBAL)."""
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _tuple(*items: bytes) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def _list(*items: bytes) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.LIST


def _dict(**items: bytes) -> bytes:
    return pickle.EMPTY_DICT + pickle.MARK + b"".join(_s(k) + v for k, v in items.items()) + pickle.SETITEMS


def _call(func: bytes, *args: bytes) -> bytes:
    return func + _tuple(*args) + pickle.REDUCE


def _getattr(obj: bytes, name: str) -> bytes:
    return _call(_g("builtins", "getattr"), obj, _s(name))


def _pk(body: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + body + pickle.STOP


class _Reduce:
    """Pickles as ``func(*args)``: the classic gadget."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


class WritingPath(pathlib.PurePosixPath):
    """A path subclass that writes a file as soon as it is built: its pickle names this module."""

    def __new__(cls, *parts):
        Path(*parts).touch()
        return super().__new__(cls, *parts)


# ---------------------------------------------------------------------------- the cases
@dataclasses.dataclass
class Case:
    id: str
    make: Callable[[Path, object], bytes]
    """make(marker, genuine Metadata) -> the .metadata bytes; running the payload creates marker."""
    expect: str
    """A substring of the refusal."""


def _touch(m: Path) -> str:
    return f"touch {m}"


def _system(m: Path) -> bytes:
    return pickle.dumps(_Reduce(os.system, _touch(m)), protocol=4)


def _nested(where: str) -> Callable[[Path, object], bytes]:
    """The genuine metadata with an ``os.system`` gadget tucked into one of its fields."""

    def make(m: Path, md: object) -> bytes:
        md = dataclasses.replace(md)
        evil = _Reduce(os.system, _touch(m))
        if where == "state_dict":
            md.state_dict_metadata = {**md.state_dict_metadata, "model/evil": evil}
        elif where == "storage_meta":
            md.storage_meta = dataclasses.replace(md.storage_meta, checkpoint_id=evil)
        elif where == "chunk":
            key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
            tsm = md.state_dict_metadata[key]
            md.state_dict_metadata = {**md.state_dict_metadata,
                                      key: dataclasses.replace(tsm, chunks=[evil, *tsm.chunks])}
        else:
            md.planner_data = {"x": [1, 2, {"y": evil}]}
        return pickle.dumps(md, protocol=4)

    return make


def _forged(change: Callable[[object], None]) -> Callable[[Path, object], bytes]:
    """The genuine metadata with its records changed (no code: checked against the files)."""

    def make(m: Path, md: object) -> bytes:
        md = pickle.loads(pickle.dumps(md))  # a deep copy
        change(md)
        return pickle.dumps(md, protocol=4)

    return make


def _storage(field: str, value: object) -> Callable[[Path, object], bytes]:
    """The genuine metadata with one field of its first storage record changed."""
    return _forged(lambda md: setattr(next(iter(md.storage_data.values())), field, value))


def _flat_entry(md) -> TensorStorageMetadata:
    return next(v for v in md.state_dict_metadata.values()
                if isinstance(v, TensorStorageMetadata) and len(v.size) == 1 and len(v.chunks) == 1)


def _huge_tensor(md) -> None:
    _flat_entry(md).size = torch.Size([10**12])  # one small chunk of a terabyte-sized tensor


def _huge_chunk(md) -> None:
    entry = _flat_entry(md)
    entry.size = torch.Size([10**12])
    entry.chunks[0].sizes = torch.Size([10**12])  # stored in a few hundred bytes


MD = "torch.distributed.checkpoint.metadata"
EXT = "torch.distributed.checkpoint._extension"
CASES = [
    # ------------------------------------------------------------------ __reduce__ gadgets
    Case("reduce-os-system", lambda m, md: _system(m), "refers to posix.system"),
    Case("reduce-subprocess-popen",
         lambda m, md: pickle.dumps(_Reduce(subprocess.Popen, ["touch", str(m)]), protocol=4),
         "refers to subprocess.Popen"),
    Case("reduce-builtins-eval",
         lambda m, md: pickle.dumps(_Reduce(eval, f"__import__('os').system('{_touch(m)}')"), protocol=4),
         "refers to builtins.eval"),
    Case("reduce-builtins-exec",
         lambda m, md: pickle.dumps(_Reduce(exec, f"open('{m}', 'w').close()"), protocol=4),
         "refers to builtins.exec"),
    Case("builtins-import-os",
         lambda m, md: _pk(_call(_getattr(_call(_g("builtins", "__import__"), _s("os")), "system"),
                                 _s(_touch(m)))),
         "refers to builtins.__import__"),
    Case("reduce-old-protocol",
         lambda m, md: pickle.dumps(_Reduce(os.system, _touch(m)), protocol=0), "refers to posix.system"),
    Case("torch-save-writes-file",
         lambda m, md: _pk(_call(_g("torch", "save"), _s("payload"), _s(str(m)))), "refers to torch.save"),
    Case("torch-from-file-creates-file",
         lambda m, md: _pk(_call(_g("torch", "from_file"), _s(str(m)), pickle.NEWTRUE, _i(8))),
         "refers to torch.from_file"),
    Case("torch-load",
         lambda m, md: _pk(_call(_g("torch", "load"), _s(str(m)))), "refers to torch.load"),
    Case("shutil-copy", lambda m, md: _pk(_call(_g("shutil", "copyfile"), _s("/etc/hostname"), _s(str(m)))),
         "refers to shutil.copyfile"),
    # ------------------------------------------------------------------ dotted names
    Case("dotted-os-through-metadata-module",  # the bug: DCP's metadata module imports os
         lambda m, md: _pk(_call(_g(MD, "os.system"), _s(_touch(m)))), f"refers to {MD}.os.system"),
    Case("dotted-torch-through-metadata-module",
         lambda m, md: _pk(_call(_g(MD, "torch.save"), _s("x"), _s(str(m)))), f"refers to {MD}.torch.save"),
    Case("dotted-os-through-torch",
         lambda m, md: _pk(_call(_g("torch", "os.system"), _s(_touch(m)))), "refers to torch.os.system"),
    Case("dotted-dtype-name-through-torch",
         lambda m, md: _pk(_call(_g("torch", "float32.__class__"), _s("x"))),
         "refers to torch.float32.__class__"),
    Case("dotted-torch-ops",
         lambda m, md: _pk(_call(_g("torch", "ops.aten.from_file"), _s(str(m)), pickle.NEWTRUE, _i(8))),
         "refers to torch.ops.aten.from_file"),
    Case("dotted-os-through-filesystem",
         lambda m, md: _pk(_call(_g("torch.distributed.checkpoint.filesystem", "os.system"), _s(_touch(m)))),
         "refers to torch.distributed.checkpoint.filesystem.os.system"),
    Case("dotted-os-through-serialization",
         lambda m, md: _pk(_call(_g("torch.serialization", "os.system"), _s(_touch(m)))),
         "refers to torch.serialization.os.system"),
    Case("dotted-through-builtins-getattr",
         lambda m, md: _pk(_call(_g("builtins", "getattr.__self__.exec"), _s(f"open('{m}', 'w').close()"))),
         "refers to builtins.getattr.__self__.exec"),
    Case("dotted-path-write-text",
         lambda m, md: _pk(_call(_g("pathlib", "Path.write_text"),
                                 _call(_g("pathlib", "PosixPath"), _s(str(m))), _s("x"))),
         "refers to pathlib.Path.write_text"),
    Case("dotted-through-allowed-class",
         lambda m, md: _pk(_call(_g(MD, "Metadata.__init__.__globals__"), _s("x"))),
         f"refers to {MD}.Metadata.__init__.__globals__"),
    Case("dotted-through-storage-info",
         lambda m, md: _pk(_call(_g("torch.distributed.checkpoint.filesystem", "_StorageInfo.__init__"),
                                 _s("x"))),
         "refers to torch.distributed.checkpoint.filesystem._StorageInfo.__init__"),
    # ------------------------------------------------------------------ names that look allowed
    Case("torch-non-dtype", lambda m, md: _pk(_call(_g("torch", "compile"), _s("x"))),
         "refers to torch.compile"),
    Case("torch-dtype-alias-unlisted", lambda m, md: _pk(_g("torch", "qint8")), "refers to torch.qint8"),
    Case("extension-descriptor-suffix",
         lambda m, md: _pk(_call(_g(EXT, "ZStandardDescriptor"), _s("x"))),
         f"refers to {EXT}.ZStandardDescriptor"),
    Case("extension-module-prefix",
         lambda m, md: _pk(_call(_g("torch.distributed.checkpoint._extension_evil", "os.systemDescriptor"),
                                 _s(_touch(m)))),
         "refers to torch.distributed.checkpoint._extension_evil.os.systemDescriptor"),
    Case("metadata-module-non-record",
         lambda m, md: _pk(_call(_g(MD, "field"), _s("x"))), f"refers to {MD}.field"),
    Case("planner-storage-info-other-module",
         lambda m, md: _pk(_g("torch.distributed.checkpoint.planner", "_StorageInfo")),
         "refers to torch.distributed.checkpoint.planner._StorageInfo"),
    Case("pathlib-subclass-writes-file",
         lambda m, md: _pk(_call(_g(__name__, "WritingPath"), _s(str(m)))),
         "WritingPath, which is not on the allow-list"),
    Case("pathlib-concrete-path-class", lambda m, md: _pk(_call(_g("pathlib", "Path"), _s(str(m)))),
         "refers to pathlib.Path"),
    Case("get-layout-real-function",
         lambda m, md: _pk(_call(_g("torch.serialization", "_get_layout"), _s("torch.os"))),
         "names the tensor layout 'torch.os'"),
    Case("collections-ordered-dict", lambda m, md: _pk(_call(_g("collections", "OrderedDict"))),
         "refers to collections.OrderedDict"),
    # ------------------------------------------------------------------ getattr
    Case("getattr-dataclass-globals-os",  # Metadata.__init__.__globals__["os"].system(...)
         lambda m, md: _pk(_call(_getattr(_call(_getattr(_getattr(_getattr(
             _g(MD, "Metadata"), "__init__"), "__globals__"), "get"), _s("os")), "system"), _s(_touch(m)))),
         "calls getattr(Metadata, '__init__')"),
    Case("getattr-enum-non-member",
         lambda m, md: _pk(_getattr(_g(MD, "_MEM_FORMAT_ENCODING"), "__init_subclass__")),
         "calls getattr(_MEM_FORMAT_ENCODING, '__init_subclass__')"),
    Case("getattr-on-size",
         lambda m, md: _pk(_getattr(_g("torch", "Size"), "__class__")), "calls getattr(Size, '__class__')"),
    # ------------------------------------------------------------------ allowed names, other uses
    Case("enum-functional-api",
         lambda m, md: _pk(_call(_g(MD, "_MEM_FORMAT_ENCODING"), _s("Evil"), _s("a b"))),
         "calls torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING with (str, str)"),
    Case("size-of-strings",
         lambda m, md: _pk(_call(_g("torch", "Size"), _s("abc"))), "calls torch.Size with (str)"),
    Case("newobj-with-arguments",
         lambda m, md: _pk(_g(MD, "Metadata") + _tuple(_dict()) + pickle.NEWOBJ),
         "creates torch.distributed"),
    Case("newobj-of-size", lambda m, md: _pk(_g("torch", "Size") + _tuple() + pickle.NEWOBJ),
         "creates torch.Size"),
    Case("newobj-ex", lambda m, md: _pk(_g(MD, "Metadata") + _tuple() + _dict() + pickle.NEWOBJ_EX),
         "opcode NEWOBJ_EX"),
    Case("build-on-class",  # would set Metadata.__eq__ for the whole process
         lambda m, md: _pk(_g(MD, "Metadata") + _tuple(pickle.NONE, _dict(__eq__=_g("torch", "Size")))
                           + pickle.BUILD),
         "sets the state of torch.distributed.checkpoint.metadata.Metadata"),
    Case("build-dunder-field",
         lambda m, md: _pk(_g(MD, "StorageMeta") + _tuple() + pickle.NEWOBJ
                           + _dict(__class__=_g(MD, "Metadata")) + pickle.BUILD),
         "sets ['__class__'] of a StorageMeta"),
    Case("build-slot-state",
         lambda m, md: _pk(_g(MD, "StorageMeta") + _tuple() + pickle.NEWOBJ
                           + _tuple(_dict(), _dict(save_id=_s("x"))) + pickle.BUILD),
         "sets 'tuple' of a StorageMeta"),
    Case("build-on-dtype",
         lambda m, md: _pk(_g("torch", "float32") + _dict(x=_i(1)) + pickle.BUILD),
         "sets the state of a dtype"),
    # ------------------------------------------------------------------ old opcodes
    Case("inst-opcode", lambda m, md: pickle.MARK + _s(_touch(m)) + b"ios\nsystem\n" + pickle.STOP,
         "opcode INST"),
    Case("inst-opcode-allowed-class",
         lambda m, md: pickle.MARK + _tuple(_i(1)) + b"itorch\nSize\n" + pickle.STOP, "opcode INST"),
    Case("obj-opcode",
         lambda m, md: pickle.MARK + _old_g("os", "system") + _s(_touch(m)) + pickle.OBJ + pickle.STOP,
         "refers to os.system"),
    Case("obj-opcode-allowed-class",
         lambda m, md: _pk(pickle.MARK + _g(MD, "StorageMeta") + pickle.OBJ), "opcode OBJ"),
    Case("ext-opcode", lambda m, md: _pk(pickle.EXT1 + b"\x01"), "opcode EXT1"),
    Case("persistent-id", lambda m, md: _pk(_s("x") + pickle.BINPERSID), "opcode BINPERSID"),
    # ------------------------------------------------------------------ gadgets nested in real metadata
    Case("nested-in-state-dict", _nested("state_dict"), "refers to posix.system"),
    Case("nested-in-storage-meta", _nested("storage_meta"), "refers to posix.system"),
    Case("nested-in-chunk-list", _nested("chunk"), "refers to posix.system"),
    Case("nested-in-planner-data", _nested("planner_data"), "refers to posix.system"),
    # ------------------------------------------------------------------ forged records (no code)
    Case("storage-path-escapes", _storage("relative_path", "../x.distcp"),
         "stored in '../x.distcp', which is not a file of the checkpoint directory"),
    Case("storage-absolute-path", _storage("relative_path", "/etc/passwd"),
         "stored in '/etc/passwd'"),
    Case("storage-beyond-file", _storage("length", 10**12),
         "is stored at bytes"),
    Case("storage-transform", _storage("transform_descriptors", ["zstd/1"]),
         "through transforms ['zstd/1']"),
    Case("huge-declared-tensor", _forged(_huge_tensor), "but its chunks hold only"),
    Case("huge-declared-chunk", _forged(_huge_chunk), "declares 2000000000000 bytes but is stored in"),
    Case("not-metadata", lambda m, md: pickle.dumps({"state_dict_metadata": {}}, protocol=4),
         "holds a dict, not DCP Metadata"),
]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    """A checkpoint of the tiny FP8 model (one step), for ``read_dcp_metadata`` and ``load_checkpoint``."""
    model, opt = cases.build()
    cases.train(model, opt, 0, 1)
    return save_checkpoint(tmp_path_factory.mktemp("genuine") / "step_1", model, opt, step=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of the training command (2 steps) with one checkpoint, for ``trainer.resume=<path>``."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    assert main(run_args(run_dir, "checkpoint.every_n_steps=2")) == 0
    (ck,) = sorted((run_dir / "checkpoints").glob("step_*"))
    return ck


@pytest.fixture(scope="module")
def fresh():
    """One model and optimizer for every load: a refused load changes neither."""
    return cases.build(seed=7)


def _hostile_copy(src: Path, dst: Path, case: Case, marker: Path) -> Path:
    """``src`` copied to ``dst`` with the case's .metadata, the manifest re-hashed to match."""
    shutil.copytree(src, dst)
    data = case.make(marker, read_dcp_metadata(src))
    (dst / ".metadata").write_bytes(data)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _class_state() -> dict[str, tuple[str, ...]]:
    """The attributes of everything the unpickler may hand out: a BUILD on one would show here."""
    out = {}
    for (module, name), obj in planner._GLOBALS.items():
        if isinstance(obj, type):
            out[f"{module}.{name}"] = tuple(sorted((k, id(v)) for k, v in vars(obj).items()))
    return out


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def test_enough_cases():
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_read_dcp_metadata_refuses(case, genuine, tmp_path):
    marker = tmp_path / "MARKER"
    ck = _hostile_copy(genuine, tmp_path / "step_1", case, marker)
    before = _class_state()
    with pytest.raises(CheckpointFormatError) as e:
        read_dcp_metadata(ck)
    msg = _one_line(e)
    assert case.expect in msg, msg
    assert not marker.exists()
    assert _class_state() == before


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_load_checkpoint_refuses(case, genuine, fresh, tmp_path):
    marker = tmp_path / "MARKER"
    ck = _hostile_copy(genuine, tmp_path / "step_1", case, marker)
    model, opt = fresh
    digests = (cases.model_digests(model), cases.optimizer_digest(opt))
    files = tree_digest(ck)
    with pytest.raises(CheckpointFormatError) as e:
        load_checkpoint(ck, model, opt)
    assert case.expect in _one_line(e)
    assert not marker.exists()
    assert (cases.model_digests(model), cases.optimizer_digest(opt)) == digests
    assert tree_digest(ck) == files


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_training_command_refuses(case, trained, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    ck = _hostile_copy(trained, tmp_path / trained.name, case, marker)
    before = tree_digest(tmp_path)
    code = main(run_args(tmp_path / "run", f"trainer.resume={ck}"))
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-2000:]}"
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) == 2, err  # the message, then the --help hint
    assert lines[0].startswith("fp8shard.train: error: trainer.resume: ") and case.expect in lines[0], err
    assert not marker.exists()
    assert tree_digest(tmp_path) == before  # no run directory, the checkpoint untouched


def test_bytes_item_is_refused_when_loaded(genuine, fresh, tmp_path):
    """A pickled (byte) entry passes the metadata checks (DCP may hold them) but is never read."""
    key = next(k for k in read_dcp_metadata(genuine).state_dict_metadata if k.startswith("model/"))
    forged = _forged(lambda md: md.state_dict_metadata.__setitem__(key, BytesStorageMetadata()))
    ck = _hostile_copy(genuine, tmp_path / "step_1", Case("bytes-item", forged, ""), tmp_path / "MARKER")
    read_dcp_metadata(ck)
    with pytest.raises(CheckpointFormatError, match="is not a tensor; refusing to unpickle it"):
        load_checkpoint(ck, *fresh)


def test_genuine_checkpoint_still_loads(genuine):
    """The allow-list admits what DCP writes on this torch: the checkpoint loads bit-exactly."""
    model, opt = cases.build(seed=11)
    info = load_checkpoint(genuine, model, opt)
    assert info.step == 1
    md = read_dcp_metadata(genuine)
    assert md.storage_meta is not None and isinstance(md.storage_meta.checkpoint_id, pathlib.PurePosixPath)


def test_allow_list_names_the_real_objects():
    """Each entry of the table that is not a stand-in is the very object its name imports."""
    import importlib

    stand_ins = {planner._layout, planner._dcp_enum_member, pathlib.PurePosixPath, pathlib.PureWindowsPath}
    for (module, name), obj in planner._GLOBALS.items():
        assert "." not in name
        if obj in stand_ins:
            continue
        assert getattr(importlib.import_module(module), name) is obj, (module, name)


def test_every_global_of_a_genuine_metadata_is_allowed(genuine):
    """What the plain unpickler would look up in a file DCP wrote here: all in the table."""
    seen = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append((module, name))
            return super().find_class(module, name)

    with open(genuine / ".metadata", "rb") as f:
        Recording(f).load()
    assert seen and all(g in planner._GLOBALS for g in seen), seen


def test_storage_outside_the_manifest_is_refused(genuine, fresh, tmp_path):
    """Metadata that reads its tensors from a file the manifest does not list (so no hash
    vouches for it) passes ``read_dcp_metadata`` (the file is there) but is never loaded."""
    def elsewhere(md) -> None:
        for info in md.storage_data.values():
            info.relative_path = "unlisted.distcp"

    case = Case("unlisted", _forged(elsewhere), "")
    ck = _hostile_copy(genuine, tmp_path / "step_1", case, tmp_path / "MARKER")
    shutil.copyfile(ck / "__0_0.distcp", ck / "unlisted.distcp")
    read_dcp_metadata(ck)
    listed = r"stores data in 'unlisted\.distcp', which manifest\.json does not list: refused"
    with pytest.raises(CheckpointFormatError, match=listed) as e:
        load_checkpoint(ck, *fresh)
    _one_line(e)

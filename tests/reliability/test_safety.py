"""Safety: nothing runs code found in a checkpoint or a config, and a run writes only inside its
run directory.

The first part is a static audit of ``src/fp8shard`` (its syntax trees, not a grep of text):
no ``eval``/``exec``/``compile``/``__import__``; no process spawning; ``pickle`` only in the
checkpoint's allow-list unpickler; YAML only through ``safe_load``/``safe_dump``;
``torch.load`` only with ``weights_only=True``; DCP reads only through ``SafeFileSystemReader``
(tests/checkpoint/test_hostile_metadata.py feeds it 60 hostile ``.metadata`` files).
The second part runs the command: ``exp_manager.name`` cannot point outside
``exp_manager.exp_dir`` (``..``, an absolute path, a nested path), and a run with checkpoints
leaves no file anywhere but its run directory.
"""

from __future__ import annotations

import ast
import enum
import io
import pickle
from pathlib import Path

import pytest
import torch

import fp8shard
from fp8shard.checkpoint import CheckpointFormatError, save_checkpoint
from fp8shard.checkpoint.planner import read_dcp_metadata
from fp8shard.train.__main__ import main
from tests.reliability.common import SMALL, tree_digest

SRC = Path(fp8shard.__file__).parent
FILES = sorted(SRC.rglob("*.py"))
BANNED_CALLS = {"eval", "exec", "compile", "__import__", "breakpoint"}
BANNED_MODULES = {"subprocess", "marshal", "shelve", "dill", "cloudpickle", "ctypes", "pty"}
# module -> the files allowed to import it, and why
ALLOWED_IMPORTS = {"pickle": {"checkpoint/planner.py"}}  # _MetadataUnpickler: an allow-list find_class
YAML_OK = {"safe_load", "safe_dump", "YAMLError"}
UNPICKLERS = {"Unpickler", "_Unpickler"}  # _Unpickler: the pure-Python one, whose opcodes can be checked


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _problems(path: Path, root: Path = SRC) -> list[str]:
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top in BANNED_MODULES:
                    out.append(f"{where}: imports {name}")
                if top in ALLOWED_IMPORTS and rel not in ALLOWED_IMPORTS[top]:
                    out.append(f"{where}: imports {name} (allowed only in {ALLOWED_IMPORTS[top]})")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if name in BANNED_CALLS:
                out.append(f"{where}: calls {name}()")
            if name in ("os.system", "os.popen") or name.startswith(("os.exec", "os.spawn")):
                out.append(f"{where}: calls {name}()")
            if name == "torch.load":
                wo = kw.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    out.append(f"{where}: torch.load without weights_only=True")
            if name.endswith("dcp.load") or name == "torch.distributed.checkpoint.load":
                reader = kw.get("storage_reader")
                if not (isinstance(reader, ast.Call) and _dotted(reader.func) == "SafeFileSystemReader"):
                    out.append(f"{where}: dcp.load without storage_reader=SafeFileSystemReader(...)")
            if name in ("pickle.load", "pickle.loads"):
                out.append(f"{where}: {name} (use the allow-list unpickler)")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "yaml" and node.attr not in YAML_OK:
                out.append(f"{where}: yaml.{node.attr} (only {sorted(YAML_OK)})")
            # The unpickler classes (to subclass) and the opcode constants (bytes) only.
            if node.value.id == "pickle" and not (node.attr in UNPICKLERS or node.attr.isupper()):
                out.append(f"{where}: pickle.{node.attr}")
        elif isinstance(node, ast.ClassDef):
            bases = {_dotted(b) for b in node.bases}
            if bases & {f"pickle.{u}" for u in UNPICKLERS}:
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                if "find_class" not in methods:
                    out.append(f"{where}: Unpickler subclass {node.name} without an allow-list find_class")
            if "FileSystemReader" in bases and node.name != "SafeFileSystemReader":
                out.append(f"{where}: another FileSystemReader subclass {node.name}")
    return out


def test_the_package_runs_no_code_from_checkpoints_or_configs():
    assert len(FILES) > 30  # the whole package was scanned
    problems = [p for f in FILES for p in _problems(f)]
    assert problems == []


def test_the_audit_catches_what_it_looks_for(tmp_path):
    """The scanner itself: each banned pattern in a file is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle, subprocess, yaml, torch\n"
                   "eval('1')\nyaml.load('a')\ntorch.load('x')\npickle.loads(b'')\n"
                   "import torch.distributed.checkpoint as dcp\ndcp.load({}, storage_reader=None)\n")
    found = "\n".join(_problems(bad, tmp_path))
    for text in ("imports subprocess", "imports pickle", "calls eval()", "yaml.load", "torch.load without",
                 "pickle.loads", "dcp.load without"):
        assert text in found, (text, found)


class _EnumAsGetattr(pickle.Pickler):
    """Pickles Enum members as ``getattr(EnumClass, name)``, as Python 3.11.2 does."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_with_enums_pickled_through_getattr_loads_but_other_getattrs_do_not(tmp_path):
    """Found running the tests as another user, whose python was 3.11.2: its DCP ``.metadata``
    holds ``builtins.getattr`` for an enum member, and the allow-list refused fp8shard's own
    checkpoints. ``getattr`` is now allowed for DCP's metadata enums only."""
    ck = tmp_path / "ck"
    save_checkpoint(ck, torch.nn.Linear(4, 4))
    raw = (ck / ".metadata").read_bytes()
    md = pickle.loads(raw)  # our own file, just written: trusted here
    buf = io.BytesIO()
    _EnumAsGetattr(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(md)
    assert b"getattr" in buf.getvalue() and b"getattr" not in raw
    (ck / ".metadata").write_bytes(buf.getvalue())
    assert read_dcp_metadata(ck).state_dict_metadata.keys() == md.state_dict_metadata.keys()
    # getattr on anything else (here: a method of an allowed class) is refused, naming it.
    evil = b"cbuiltins\ngetattr\n(ctorch\nSize\nV__reduce__\ntR."
    (ck / ".metadata").write_bytes(evil)
    with pytest.raises(CheckpointFormatError, match=r"getattr\(Size, '__reduce__'\).*refused"):
        read_dcp_metadata(ck)


@pytest.mark.parametrize("name", ["../outside", "/ABS/outside", "a/b", "..", ".", ""])
def test_a_run_name_pointing_outside_the_experiment_directory_is_refused(name, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    name = name.replace("/ABS", str(tmp_path))
    before = tree_digest(tmp_path)
    code = main([*SMALL, f"exp_manager.exp_dir={tmp_path / 'exp'}", f"exp_manager.name={name}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("fp8shard.train: error: exp_manager.name must be one directory name"), err
    assert tree_digest(tmp_path) == before
    assert not (tmp_path / "exp").exists() and not (tmp_path / "outside").exists()


def test_a_run_writes_only_inside_its_run_directory(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run = tmp_path / "exp" / "run"
    assert main([*SMALL, "checkpoint.every_n_steps=1", f"exp_manager.exp_dir={run.parent}",
                 f"exp_manager.name={run.name}"]) == 0
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.is_relative_to(run) for p in written), written
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints"}
    assert list(cwd.iterdir()) == []

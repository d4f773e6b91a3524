"""The checkpoint manifest (``manifest.json``): reading it and checking every field before use.

The manifest is a checkpoint's completion marker and its description ([Note: atomic
checkpoints] in io.py): format and version, step, world size, model and optimizer entries, the
caller's ``extra``, and the size and SHA-256 of every file. Here: its name and limits,
:func:`read_manifest` (format, version, then :func:`check_manifest` field by field, so no
manifest can make a load allocate more than the files hold), and the checks of the files
against it (:func:`verify_files`, :func:`check_storage_listed`). Writing it is
:func:`~fp8shard.checkpoint.io.save_checkpoint`'s.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import fp8shard
from fp8shard.checkpoint import state as ms
from fp8shard.checkpoint.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError
from fp8shard.checkpoint.optim_state import DFA_KIND
from fp8shard.checkpoint.planner import is_plain_name, regular_file_size
from fp8shard.fp8 import Fp8Format

FORMAT = "fp8shard.checkpoint"
VERSION = 2
"""The newest checkpoint format version this fp8shard reads; loading refuses a newer one. Bump
when keys or meanings change. Version 2 added FP8 weights with a scale per row or block
(``fp8_block`` in a model entry); a checkpoint without them is written as version 1, so that
releases reading only version 1 still load it (``format_version``)."""
MANIFEST = "manifest.json"
MAX_STEP = 2**53
"""Largest step a manifest may name (exact as a float64, far beyond any run)."""
MAX_WORLD_SIZE = 2**20
MAX_MANIFEST_BYTES = 256 << 20
"""A manifest is a few KB per hundred parameters; anything past this is refused unread."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FP8_FORMATS = tuple(f.value for f in Fp8Format)


def format_version(entries: dict[str, dict[str, Any]]) -> int:
    """The version a checkpoint of these model entries is written in: 2 when a weight carries a
    scale grid (``fp8_block``: an older reader would take its scales for one per tensor and
    misread every tile), else 1."""
    return 2 if any(e.get("fp8_block") for e in entries.values()) else 1


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file, as the manifest records it (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def manifest_or_none(path: Path) -> dict[str, Any] | None:
    """The manifest of ``path`` if it reads as one of ours (format only, no field checks), else None."""
    try:
        m = _read_json(path / MANIFEST)
    except (OSError, CheckpointError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT else None


def _read_json(mf: Path) -> Any:
    """The JSON of ``mf``: a regular file of at most ``MAX_MANIFEST_BYTES``, UTF-8."""
    size = regular_file_size(mf)
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointFormatError(f"{mf} has {size} bytes, more than a manifest ever holds "
                                    f"({MAX_MANIFEST_BYTES}): refused unread")
    try:
        return json.loads(mf.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{mf} is damaged (not UTF-8 text: byte {e.start})") from None
    except RecursionError:
        raise CheckpointFormatError(f"{mf} is damaged (JSON nested too deeply)") from None
    except ValueError as e:
        raise CheckpointFormatError(f"{mf} is damaged (not JSON: {e})") from None


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, checked for format and version and field by field
    (see :func:`check_manifest`)."""
    mf = path / MANIFEST
    if not mf.exists() and not mf.is_symlink():
        raise CheckpointNotFoundError(f"{path} has no {MANIFEST}: not a complete checkpoint")
    m = _read_json(mf)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointFormatError(f"{mf} is not an fp8shard checkpoint manifest")
    v = m.get("version")
    if type(v) is int and v > VERSION:
        raise CheckpointFormatError(
            f"{path} is in checkpoint format version {v!r} (written by fp8shard "
            f"{str(m.get('fp8shard_version', '?'))[:40]}); this fp8shard {fp8shard.__version__} reads "
            f"versions up to {VERSION}: upgrade fp8shard to load it")
    check_manifest(m, mf)
    return m


class _Bad:
    """Raises the one-line error for a manifest field, naming it (``model['fc.weight'].shape``)."""

    def __init__(self, mf: Path) -> None:
        self.mf = mf

    def __call__(self, field: str, what: str, value: Any = None) -> CheckpointFormatError:
        got = "" if value is None else f", got {_short(value)}"
        return CheckpointFormatError(f"{self.mf}: field {field} {what}{got}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_manifest(m: dict[str, Any], mf: Path) -> None:
    """Every field of a manifest that fp8shard reads has its type and range, or
    ``CheckpointFormatError`` names the first that does not. Tensor shapes are bounded by the
    files: no manifest makes a load allocate more elements than the checkpoint has bytes.
    ``extra`` is the caller's and only has to be an object."""
    bad = _Bad(mf)
    if not _is_int(m.get("version"), 1, VERSION):
        raise bad("version", f"must be an integer from 1 to {VERSION}", m.get("version"))
    for key in ("fp8shard_version", "torch_version"):
        if key in m and not isinstance(m[key], str):
            raise bad(key, "must be a string", m[key])
    step = m.get("step")
    if step is not None and not _is_int(step, 0, MAX_STEP):
        raise bad("step", f"must be null or an integer from 0 to {MAX_STEP}", step)
    if not _is_int(m.get("world_size"), 1, MAX_WORLD_SIZE):
        raise bad("world_size", f"must be an integer from 1 to {MAX_WORLD_SIZE}", m.get("world_size"))
    if not isinstance(m.get("rng_saved"), bool):
        raise bad("rng_saved", "must be true or false", m.get("rng_saved"))
    if not isinstance(m.get("extra", {}), dict):
        raise bad("extra", "must be an object", m.get("extra"))
    held = _check_files(m.get("files"), bad)
    declared = _check_model(m.get("model"), bad, held)
    declared += _check_optimizer(m.get("optimizer"), bad, held)
    if declared > held:
        raise CheckpointFormatError(f"{mf}: fields model and optimizer declare tensors of {declared} "
                                    f"elements, more than the {held} bytes of the checkpoint's files")


def _check_files(files: Any, bad: _Bad) -> int:
    if not isinstance(files, dict) or ".metadata" not in files:
        raise bad("files", "must be an object listing .metadata and the data files", files)
    held = 0
    for name, f in files.items():
        if not is_plain_name(name) or name == MANIFEST:
            raise bad("files", "may only name files directly inside the checkpoint directory", name)
        if not isinstance(f, dict):
            raise bad(f"files[{name!r}]", "must be an object with size and sha256", f)
        if not _is_int(f.get("size"), 0, 2**62):
            raise bad(f"files[{name!r}].size", "must be an integer >= 0", f.get("size"))
        if not (isinstance(f.get("sha256"), str) and _SHA256.fullmatch(f["sha256"])):
            raise bad(f"files[{name!r}].sha256", "must be 64 lowercase hex digits", f.get("sha256"))
        held += f["size"]
    return held


def _check_shape(shape: Any, field: str, bad: _Bad, held: int) -> int:
    if not (isinstance(shape, list) and len(shape) <= 64 and all(_is_int(d, 0, 2**62) for d in shape)):
        raise bad(field, "must be a list of at most 64 integers >= 0", shape)
    n = _numel(shape)
    if n > held:
        raise bad(field, f"declares {n} elements, more than the {held} bytes of the checkpoint's files",
                  shape)
    return n


def _check_dtype(name: Any, field: str, bad: _Bad) -> None:
    if not (isinstance(name, str) and name in ms.DTYPES):
        raise bad(field, "must name a torch dtype", name)


def _check_model(model: Any, bad: _Bad, held: int) -> int:
    if not isinstance(model, dict):
        raise bad("model", "must be an object", model)
    total = 0
    for name, e in model.items():
        where = f"model[{name!r}]"
        if not name or not isinstance(e, dict):
            raise bad(where, "must be an object with kind, shape, dtype and fp8", e)
        if e.get("kind") not in ("param", "buffer"):
            raise bad(f"{where}.kind", "must be 'param' or 'buffer'", e.get("kind"))
        total += _check_shape(e.get("shape"), f"{where}.shape", bad, held)
        _check_dtype(e.get("dtype"), f"{where}.dtype", bad)
        if e.get("fp8") is not None and e.get("fp8") not in _FP8_FORMATS:
            raise bad(f"{where}.fp8", f"must be null or one of {list(_FP8_FORMATS)}", e.get("fp8"))
        block = e.get("fp8_block")
        if block is not None and not (e.get("fp8") and isinstance(block, list) and len(block) == 2
                                      and len(e["shape"]) == 2 and all(
                                          type(b) is int and 1 <= b <= 1 << 20 for b in block)):
            raise bad(f"{where}.fp8_block", "must be null or [rows, cols] of a 2-D FP8 weight's tile, "
                      "each an int in [1, 2**20]", block)
    return total


def _check_groups(groups: Any, bad: _Bad) -> list[str]:
    if not isinstance(groups, list) or not groups:
        raise bad("optimizer.param_groups", "must be a non-empty list", groups)
    names = []
    for i, g in enumerate(groups):
        params = g.get("params") if isinstance(g, dict) else None
        if not (isinstance(params, list) and all(isinstance(n, str) for n in params)):
            raise bad(f"optimizer.param_groups[{i}].params", "must be a list of parameter names", params)
        names += params
    return names


def _check_optimizer(opt: Any, bad: _Bad, held: int) -> int:
    if opt is None:
        return 0
    if not isinstance(opt, dict) or not isinstance(opt.get("kind"), str):
        raise bad("optimizer", "must be null or an object with a kind", opt)
    names = _check_groups(opt.get("param_groups"), bad)
    total = 0
    if opt["kind"] == DFA_KIND:
        if not _is_int(opt.get("step"), 0, MAX_STEP):
            raise bad("optimizer.step", f"must be an integer from 0 to {MAX_STEP}", opt.get("step"))
        _check_dtype(opt.get("state_dtype"), "optimizer.state_dtype", bad)
        params = opt.get("params")
        if not isinstance(params, dict) or not all(n in params for n in names):
            raise bad("optimizer.params", "must be an object with an entry for every parameter of "
                      "param_groups", params)
        for name, p in params.items():
            where = f"optimizer.params[{name!r}]"
            if not isinstance(p, dict) or not _is_int(p.get("numel"), 0, held) \
                    or not isinstance(p.get("fp8"), bool):
                raise bad(where, "must be an object with numel (an integer from 0 to the checkpoint's "
                          "bytes) and fp8 (true or false)", p)
            if "amax_history_len" in p and not _is_int(p["amax_history_len"], 1, 2**20):
                raise bad(f"{where}.amax_history_len", "must be an integer >= 1", p["amax_history_len"])
            total += p["numel"]
        return total
    state = opt.get("state")
    if not isinstance(state, dict):
        raise bad("optimizer.state", "must be an object", state)
    for name, st in state.items():
        if not isinstance(st, dict):
            raise bad(f"optimizer.state[{name!r}]", "must be an object", st)
        for k, v in st.items():
            where = f"optimizer.state[{name!r}][{k!r}]"
            if isinstance(v, dict) and "tensor" in v:
                total += _check_shape(v["tensor"], f"{where}.tensor", bad, held)
                _check_dtype(v.get("dtype"), f"{where}.dtype", bad)
            elif not (isinstance(v, dict) and "value" in v):
                raise bad(where, "must be an object with either tensor and dtype, or value", v)
    return total


def verify_files(path: Path, manifest: dict[str, Any], rank: int = 0, world: int = 1) -> None:
    """Check this rank's share of the files against the manifest's sizes and hashes."""
    files: dict[str, dict[str, Any]] = manifest["files"]
    names = sorted(files)
    for n in names:  # sizes are cheap: every rank checks all
        f = path / n
        size = regular_file_size(f)
        if size != files[n]["size"]:
            raise CheckpointFormatError(f"{f} has {size} bytes, the manifest says {files[n]['size']}: the "
                                        "file is truncated or overwritten")
    for n in names[rank::world]:
        if sha256_file(path / n) != files[n]["sha256"]:
            raise CheckpointFormatError(f"{path / n} is corrupted: its SHA-256 does not match the manifest")


def check_storage_listed(path: Path, md: Any, manifest: dict[str, Any]) -> None:
    """Every file DCP's metadata reads from is listed in the manifest, so its hash was checked."""
    for info in md.storage_data.values():
        if info.relative_path not in manifest["files"]:
            raise CheckpointFormatError(f"{path / '.metadata'} stores data in {info.relative_path!r}, "
                                        f"which {MANIFEST} does not list: refused")

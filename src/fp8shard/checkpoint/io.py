"""Saving and loading checkpoints with ``torch.distributed.checkpoint``, atomically.

[Note: atomic checkpoints]
    A checkpoint is a directory: DCP's ``.metadata`` and one ``__<rank>_0.distcp`` per rank
    (each rank writes its own in parallel; entries every rank holds are written once), plus
    ``manifest.json`` -- format version, step, world size, the model and optimizer description,
    the user's JSON ``extra``, and the size and SHA-256 of every file. The manifest is the
    completion marker:

      1. all ranks write into ``<root>/.tmp-<name>`` (DCP, files fsynced);
      2. every rank hashes a share of the files; rank 0 checks that every file DCP's metadata
         refers to exists and is long enough, then writes the manifest (tmp file, fsync, rename);
      3. rank 0 renames ``.tmp-<name>`` to ``<name>`` (one atomic rename), fsyncs the root,
         rewrites ``<root>/latest`` (tmp file, rename), and prunes old checkpoints (each renamed
         to ``.trash-*`` before it is deleted, so a half-deleted one never looks complete).

    A process killed at any moment leaves either no ``<name>`` (the previous checkpoint is the
    newest complete one) or a complete ``<name>``. :func:`latest_checkpoint` takes the newest
    directory with a valid manifest, so it is right even when a kill fell between the rename
    and the ``latest`` update. Loading re-checks sizes and hashes before reading any tensor.
    All ranks must see the same file system (one node, or a shared file system).

Reading and checking the manifest, and the files against it, is manifest.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import fp8shard
from fp8shard.checkpoint import state as ms
from fp8shard.checkpoint.errors import (
    ERRORS,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)
from fp8shard.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    check_storage_listed,
    format_version,
    manifest_or_none,
    read_manifest,
    sha256_file,
    verify_files,
)
from fp8shard.checkpoint.optim_state import optimizer_load, optimizer_save_state, param_names
from fp8shard.checkpoint.planner import (
    FlatPieces,
    PiecesLoadPlanner,
    PiecesSavePlanner,
    SafeFileSystemReader,
    read_dcp_metadata,
)
from fp8shard.checkpoint.rng import capture_rng, restore_rng, rng_key
from fp8shard.optim.core import ShardedAdam

LATEST = "latest"
_T = TypeVar("_T")


@dataclasses.dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` read besides tensors."""

    path: Path
    step: int | None
    world_size: int
    """World size the checkpoint was written at."""
    extra: dict[str, Any]
    """The JSON ``extra`` given to :func:`save_checkpoint`."""
    rng_restored: bool
    """True when this rank's RNG states were restored (same world size and ``load_rng``)."""


# ---------------------------------------------------------------------------- process group
def _rank_world(group: Any) -> tuple[int, int]:
    if not _no_dist():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                                "uninitialized")
        yield


def _all_gather(obj: Any, group: Any) -> list[Any]:
    if _no_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _together(fn: Callable[[], _T], group: Any) -> _T:
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (no rank is left
    waiting in the next collective). A rank re-raises its own error, others the first one."""
    try:
        result, err = fn(), None
    except Exception as e:  # any failure must reach the other ranks before they block
        result, err = None, e
    code = err.errno if isinstance(err, (OSError, CheckpointSaveError)) else None
    errors = _all_gather(None if err is None else (type(err).__name__, str(err), code), group)
    if err is not None:
        raise err
    for r, e in enumerate(errors):
        if e is not None:
            if e[2] is not None:  # an OSError there: a storage fault, with its errno
                raise CheckpointSaveError(f"(raised on rank {r}) {e[1]}", e[2])
            cls = ERRORS.get(e[0], CheckpointError)
            raise cls(f"(raised on another rank) {e[1]}")
    return result  # type: ignore[return-value]


# ---------------------------------------------------------------------------- file system
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` so readers see the old content or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _hash_share(directory: Path, names: list[str], rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of this rank's share of the files (round robin), so hashing is parallel."""
    return {n: {"size": (directory / n).stat().st_size, "sha256": sha256_file(directory / n)}
            for n in names[rank::world]}


def _remove_tree(path: Path) -> None:
    """Rename first, then delete: a half-deleted checkpoint must never look complete."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------------------- finding checkpoints
def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` goes under ``root``: ``root/step_00000010``."""
    return Path(root) / f"step_{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (a valid manifest) directly under ``root``, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        m = manifest_or_none(child)
        if m is not None:
            step = m.get("step")
            found.append((step if isinstance(step, int) else -1, child.name, child))
    return [p for _, _, p in sorted(found, key=lambda t: (t[0], t[1]), reverse=True)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None. See [Note: atomic checkpoints]."""
    found = list_checkpoints(root)
    return found[0] if found else None


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints (and never the one
    ``latest`` names); also clears leftovers of interrupted saves. Returns what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.exists() else None
    gone = [p for p in list_checkpoints(root)[keep_last:] if p.name != named]
    for p in gone:
        _remove_tree(p)
    for leftover in root.glob(".trash-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return gone


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one under it."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {p}: the directory does not exist")
    if (p / MANIFEST).exists():
        return p
    newest = latest_checkpoint(p)
    if newest is not None:
        return newest
    if (p / ".metadata").exists() or p.name.startswith(".tmp-"):
        raise CheckpointFormatError(f"{p} is an incomplete checkpoint (no {MANIFEST}: its save did not "
                                    "finish); load the previous one")
    raise CheckpointNotFoundError(f"no checkpoint at {p}: neither a checkpoint (no {MANIFEST}) nor a "
                                  "directory holding complete ones")


# ---------------------------------------------------------------------------- save
def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: dict[str, Any] | None = None, step: int | None = None,
                    keep_last: int | None = None, save_rng: bool = True,
                    process_group: Any = None) -> Path:
    """Write a checkpoint of ``model`` (and ``optimizer``) to directory ``path``, atomically.

    Collective: every rank of ``process_group`` calls it with the same path. ``extra`` is JSON
    (config, data position, scheduler state...) returned by :func:`load_checkpoint`. Afterwards
    ``path.parent/latest`` names it and, with ``keep_last``, older checkpoints beside it are
    deleted. See [Note: atomic checkpoints] and [Note: checkpoint keys].
    """
    final = Path(path).absolute()
    root, tmp = final.parent, final.parent / f".tmp-{final.name}"
    rank, world = _rank_world(process_group)
    if isinstance(optimizer, ShardedAdam):
        optimizer.wait_param_sync()  # in-flight all-gathers are still writing the weights

    def prepare() -> tuple[dict[str, torch.Tensor], dict[str, FlatPieces], dict[str, Any]]:
        tensors, entries = ms.model_save_state(model)
        flat: dict[str, FlatPieces] = {}
        section = None
        if optimizer is not None:
            opt_tensors, flat, section = optimizer_save_state(optimizer, param_names(model, optimizer))
            tensors.update(opt_tensors)
        if save_rng:
            tensors.update(capture_rng(rank))
        s = step if step is not None else (section or {}).get("step")
        manifest = {"format": FORMAT, "version": format_version(entries), "step": s, "world_size": world,
                    "fp8shard_version": fp8shard.__version__, "torch_version": torch.__version__,
                    "rng_saved": save_rng, "model": entries, "optimizer": section, "extra": extra or {}}
        try:
            json.dumps(manifest)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"save_checkpoint(extra=...) must be JSON-serializable: {e}") from None
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for leftover in [*root.glob(".tmp-*"), *root.glob(".trash-*")]:
                shutil.rmtree(leftover, ignore_errors=True)  # of saves killed earlier
            tmp.mkdir()
        return tensors, flat, manifest

    def listing() -> tuple[list[str], dict[str, dict[str, Any]]]:
        names = sorted(n for n in os.listdir(tmp) if n != MANIFEST)
        return names, _hash_share(tmp, names, rank, world)

    try:
        # _together also acts as the barrier: rank 0 made the directory before anyone writes into it.
        tensors, flat, manifest = _together(prepare, process_group)
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
        with single_process_quiet():
            dcp.save(tensors, storage_writer=writer, planner=PiecesSavePlanner(flat),
                     process_group=process_group, no_dist=_no_dist())
        parts = _all_gather(_together(listing, process_group), process_group)
    except (OSError, CheckpointSaveError, CheckpointException) as e:
        # Every rank is here (DCP and _together raise everywhere): nothing was published.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(final, e, world) from None
    names = parts[0][0]

    def publish() -> None:
        if rank != 0:
            return
        files: dict[str, dict[str, Any]] = {}
        for _, share in parts:
            files.update(share)
        _check_complete(tmp, names, files)
        atomic_write_text(tmp / MANIFEST, json.dumps({**manifest, "files": files}, indent=1))
        if final.exists():
            _remove_tree(final)
        tmp.rename(final)
        try:  # published: what follows is housekeeping, and its failure loses nothing
            _fsync_dir(root)
            atomic_write_text(root / LATEST, final.name + "\n")
            if keep_last is not None:
                prune_checkpoints(root, keep_last)
        except OSError as e:
            warnings.warn(f"checkpoint {final} was published, but updating {root / LATEST} or pruning old "
                          f"checkpoints failed: {e}", RuntimeWarning, stacklevel=2)

    try:
        _together(publish, process_group)
    except (OSError, CheckpointSaveError) as e:
        if rank == 0 and tmp.exists():  # not renamed: not published
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(final, e, world) from None
    return final


def _save_error(final: Path, e: BaseException, world: int) -> CheckpointSaveError:
    """One message for a failed save, naming the failing rank and its ``OSError`` ([Note: storage
    faults]); DCP's ``CheckpointException`` carries every failing rank's exception and traceback."""
    where, cause = "", e
    if isinstance(e, CheckpointException):
        failures = e.failures
        first = min(failures)
        where, cause = f" on rank {first}" if world > 1 else "", failures[first][0]
    if isinstance(cause, CheckpointSaveError) and cause.errno is not None:
        code: int | None = cause.errno
    else:
        code = cause.errno if isinstance(cause, OSError) else None
    text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    return CheckpointSaveError(f"saving checkpoint {final} failed{where}: {text} (nothing was published; "
                               "the complete checkpoints beside it are untouched)", code)


def _check_complete(tmp: Path, names: list[str], files: dict[str, dict[str, Any]]) -> None:
    """Every file DCP's metadata refers to exists and holds the bytes it says (before publishing)."""
    if ".metadata" not in names:
        raise CheckpointError(f"DCP wrote no .metadata into {tmp}; not publishing")
    md = read_dcp_metadata(tmp)
    for info in md.storage_data.values():
        n = info.relative_path
        if n not in files:
            raise CheckpointError(f"{tmp / n} (in DCP's metadata) was not written; not publishing")
        if info.offset + info.length > files[n]["size"]:
            raise CheckpointError(f"{tmp / n} is shorter than DCP's metadata says; not publishing")


# ---------------------------------------------------------------------------- load
def _check_keys(md: Any, want: dict[str, list[int]]) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, shape in want.items():
        got = md.state_dict_metadata.get(key)
        if got is None:
            raise CheckpointFormatError(f"the checkpoint's DCP metadata lacks {key!r}, which its manifest "
                                        "lists: the checkpoint is damaged")
        if not isinstance(got, TensorStorageMetadata):
            raise CheckpointFormatError(f"checkpoint entry {key!r} is not a tensor; refusing to unpickle it")
        if list(got.size) != list(shape):
            raise CheckpointFormatError(f"checkpoint entry {key!r} has shape {tuple(got.size)} in DCP's "
                                        f"metadata but {tuple(shape)} in the manifest: damaged")


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, strict: bool = True, load_rng: bool = True, verify: bool = True,
                    process_group: Any = None) -> LoadedCheckpoint:
    """Load a checkpoint written at any world size into ``model`` (and ``optimizer``), in place.

    Collective. ``path`` is a checkpoint or a root holding checkpoints (the newest complete one
    is taken). Everything is checked first -- format version, file sizes and hashes
    (``verify``), model entries and shapes, optimizer kind and groups -- and only when all of it
    fits and every tensor was read is anything copied into the model or optimizer; any problem
    raises a ``CheckpointError`` naming it, on every rank, with nothing changed.
    """
    rank, world = _rank_world(process_group)

    def check() -> tuple[Path, dict[str, Any], dict[str, torch.Tensor], dict[str, FlatPieces], Callable]:
        ck = resolve_checkpoint(path)
        manifest = read_manifest(ck)
        if verify:
            verify_files(ck, manifest, rank, world)
        md = read_dcp_metadata(ck)
        check_storage_listed(ck, md, manifest)
        entries = manifest["model"]
        names = ms.check_model(model, entries, strict)
        targets = ms.model_targets(names, entries)
        want = {k: shape for n in names for k, (shape, _) in ms.model_keys(n, entries[n]).items()}
        flat: dict[str, FlatPieces] = {}
        opt_apply: Callable[[], None] = lambda: None
        if optimizer is not None:
            load = optimizer_load(optimizer, param_names(model, optimizer), manifest.get("optimizer"))
            targets.update(load.tensors)
            flat, opt_apply = load.flat, load.apply
            want.update({k: list(t.shape) for k, t in load.tensors.items()})
            want.update({k: [fp.numel] for k, fp in flat.items()})
        rng = load_rng and manifest.get("rng_saved") and manifest["world_size"] == world
        if rng:
            for key, m in md.state_dict_metadata.items():
                if key.startswith(rng_key(rank, "")):
                    targets[key] = torch.empty(list(m.size), dtype=m.properties.dtype)
                    want[key] = list(m.size)
        _check_keys(md, want)

        def apply() -> bool:
            ms.apply_model(model, names, entries, targets, strict)
            opt_apply()
            if rng:
                restore_rng(rank, {k: v for k, v in targets.items() if k.startswith(ms.RNG)})
            return bool(rng)

        return ck, manifest, targets, flat, apply

    ck, manifest, targets, flat, apply = _together(check, process_group)
    try:
        with single_process_quiet():
            dcp.load(targets, storage_reader=SafeFileSystemReader(ck), planner=PiecesLoadPlanner(flat),
                     process_group=process_group, no_dist=_no_dist())
    except Exception as e:  # DCP wraps per-rank failures; name the checkpoint
        raise CheckpointFormatError(f"reading {ck} failed (nothing was loaded): {e}") from e
    restored = _together(apply, process_group)
    return LoadedCheckpoint(ck, manifest.get("step"), int(manifest["world_size"]),
                            manifest.get("extra") or {}, restored)


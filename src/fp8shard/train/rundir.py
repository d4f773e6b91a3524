"""The run directory: one job at a time (a lock), what an interrupted job leaves tidy, and
clearing an earlier run for ``trainer.overwrite=true``.

[Note: run directory lock]
    Rank 0 holds ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<run dir>/.fp8shard.lock`` for the
    run's life; the file says who holds it (pid, host, start time). A second job pointed at the
    same directory fails to take it and stops at once with one line naming the directory and
    the holder; rank 0 tells the other ranks through one broadcast, so every rank stops with
    one line each (exit 2) and nothing of the first job's is touched. The lock is the first
    thing a run writes: when the start-up checks after it fail (the data, the checkpoint to
    resume), the lock file is removed again, and so are the directories that taking it created,
    so a refused start leaves nothing behind. At the end of the run the lock file is removed
    while still held. flock locks belong to the open file, not the path, so a job that opened
    the file just before it was removed could lock a file that no longer has a name; it checks
    after locking that the path still names the file it locked, and tries again if not.
    The kernel drops the lock when the process dies (SIGKILL, OOM), so a crashed run never
    leaves a stale lock; a lock file left by one names no holder and is taken over. flock
    works across processes of one machine and on local file systems; on network file systems
    it depends on the server (NFSv4 emulates it with byte-range locks).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

LOCK_NAME = ".fp8shard.lock"


class RunDirInUse(Exception):
    """Another job holds the run directory's lock; the message (one line) names it."""


class RunDirLock:
    """The lock of one run directory; ``acquire()`` returns None or why it could not."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None
        self.created_dirs: list[Path] = []

    def acquire(self) -> str | None:
        """Take the lock (creating the run directory if needed); the reason on failure."""
        self.created_dirs = _mkdirs(self.run_dir)
        for _ in range(10):  # see [Note: run directory lock]: the path may be re-created under us
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                return (f"{self.run_dir} is in use by another training job ({self._holder()}); a second job "
                        "there would overwrite its checkpoints and metrics: wait for it to end, stop it, "
                        "or set another exp_manager.name")
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            started = datetime.datetime.now().isoformat(timespec="seconds")
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode())
            self.fd = fd
            return None
        raise OSError(f"could not lock {self.path}: it keeps being replaced")

    def _holder(self) -> str:
        try:
            text = self.path.read_text(errors="replace").strip()
        except OSError:
            text = ""
        return f"held by {text}" if text else "its holder is not known"

    def release(self, remove_created: bool = False) -> None:
        """Remove the lock file and unlock; ``remove_created``: also the directories acquire()
        created, where they are empty (a start-up that was refused leaves nothing)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None
        if remove_created:
            for d in reversed(self.created_dirs):
                with contextlib.suppress(OSError):
                    d.rmdir()  # only when empty
        self.created_dirs = []


def _mkdirs(path: Path) -> list[Path]:
    """``path.mkdir(parents=True, exist_ok=True)``, returning the directories it created (outermost first)."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    created = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        created.append(d)
    return created


def remove_partial_files(run_dir: Path, ckpt_root: Path, own_only: bool = False) -> list[Path]:
    """Remove what an interrupted save or write leaves: ``.tmp-*`` and ``.trash-*`` directories
    under ``ckpt_root`` (not with ``own_only``), and this process's ``.*.tmp-<pid>`` files and
    ``.trash-*-<pid>`` directories in both directories."""
    gone: list[Path] = []
    pid = os.getpid()
    for root in (ckpt_root, run_dir):
        if not root.is_dir():
            continue
        for p in root.iterdir():
            ours = p.name.startswith(".trash-") and p.name.endswith(f"-{pid}")
            leftover = not own_only and root == ckpt_root and p.name.startswith((".tmp-", ".trash-"))
            partial_dir = (ours or leftover) and p.is_dir()
            partial_file = p.name.startswith(".") and p.name.endswith(f".tmp-{pid}") and p.is_file()
            if partial_dir:
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p)
            elif partial_file:
                with contextlib.suppress(OSError):
                    p.unlink()
                    gone.append(p)
    return gone


def lock_run_dir(run_dir: Path, is_main: bool, group: Any) -> RunDirLock | None:
    """Rank 0 takes the run directory's lock; every rank learns the outcome (one broadcast over
    ``group``, when there is one) and raises ``RunDirInUse`` if it was refused."""
    lock = RunDirLock(run_dir) if is_main else None
    why: str | None = None
    if lock is not None:
        try:
            why = lock.acquire()
        except OSError as e:
            why = f"cannot lock {lock.path}: {e.strerror or e}"
    if group is not None:
        box = [why]
        dist.broadcast_object_list(box, src=0, group=group)
        why = box[0]
    if why is not None:
        raise RunDirInUse(why)
    return lock


def delete_earlier_run(run_dir: Path, ckpt_root: Path) -> list[str]:
    """trainer.overwrite=true: remove the run directory's checkpoints, metrics and summary;
    returns the note saying what went (none when nothing was there)."""
    gone = []
    if ckpt_root.exists():
        trash = run_dir / f".trash-checkpoints-{os.getpid()}"
        ckpt_root.rename(trash)  # one rename: no half-deleted checkpoint is ever visible
        shutil.rmtree(trash, ignore_errors=True)
        gone.append("checkpoints/")
    for name in ("metrics.jsonl", "summary.json"):
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()
            gone.append(name)
    if not gone:
        return []
    return [f"trainer.overwrite=true: deleted the earlier run's {', '.join(gone)} in {run_dir}"]

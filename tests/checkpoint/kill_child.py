"""Killed in the middle of a save: ``python -m tests.checkpoint.kill_child ROOT PHASE...``.

For each phase this process forks a child (torch is imported but has run nothing, so forking
is safe) that trains the tiny model, saves ``ROOT/PHASE/step_1`` completely, trains on, and
then SIGKILLs itself at PHASE of saving ``step_2``. It prints one JSON line per phase with the
child's exit signal and the digests of what ``step_1`` and ``step_2`` hold (so the test can tell
which checkpoint it resumed from).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed.checkpoint.filesystem as dcp_fs

from fp8shard.checkpoint import io as ckio
from fp8shard.checkpoint import save_checkpoint
from tests.checkpoint import cases

PHASES = ("dcp_write", "hashing", "manifest", "after_rename", "prune")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _inject(phase: str) -> None:
    """Make the save that follows SIGKILL this process at ``phase``."""
    if phase == "dcp_write":  # after the first tensor of this rank's shard file is written
        orig, calls = dcp_fs._write_item, []

        def write_item(*a, **k):
            calls.append(1)
            if len(calls) > 1:
                _die()
            return orig(*a, **k)

        dcp_fs._write_item = write_item
    elif phase == "hashing":  # shard files and DCP metadata written, no manifest
        ckio._hash_share = lambda *a, **k: _die()
    elif phase in ("manifest", "after_rename"):
        orig_write = ckio.atomic_write_text

        def write(path: Path, text: str) -> None:
            if phase == "manifest" and path.name == ckio.MANIFEST:
                tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
                tmp.write_text(text[: len(text) // 2])  # half the manifest, then the kill
                _die()
            if phase == "after_rename" and path.name == ckio.LATEST:
                _die()  # published by rename, `latest` still names step_1
            orig_write(path, text)

        ckio.atomic_write_text = write
    elif phase == "prune":  # step_1 renamed to .trash-*, partly deleted
        def rmtree(path, ignore_errors=False):
            next(Path(path).glob("*.distcp")).unlink()
            _die()

        ckio.shutil.rmtree = rmtree  # type: ignore[assignment]


def child(root: Path) -> None:
    model, opt = cases.build()
    cases.train(model, opt, 0, 1)
    save_checkpoint(root / "step_1", model, opt, step=1, keep_last=1)
    digests = [cases.optimizer_digest(opt)]
    cases.train(model, opt, 1, 2)
    digests.append(cases.optimizer_digest(opt))
    (root / "digests.json").write_text(json.dumps(digests))
    _inject(root.name)
    save_checkpoint(root / "step_2", model, opt, step=2, keep_last=1)
    os._exit(0)  # not reached when the kill works


def main(root: str, phases: list[str]) -> None:
    for phase in phases:
        d = Path(root) / phase
        d.mkdir(parents=True)
        pid = os.fork()
        if pid == 0:
            try:
                child(d)
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        print(json.dumps({"phase": phase, "signal": sig}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(PHASES))

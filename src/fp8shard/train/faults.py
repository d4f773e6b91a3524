"""Run-time faults the training loop survives or turns into errors, and the hooks that inject them.

[Note: skipped steps]
    A step whose gradients are not finite (a non-finite loss makes them so) is skipped: the
    optimizer's step is not taken, so no weight, moment or step count changes; the record says
    ``skipped`` and the count ``skipped_steps`` goes to metrics.jsonl and summary.json. The
    decision is global (DistributedFusedAdam all-reduces a non-finite count; DDP's gradients are
    already averaged), so every rank skips the same steps. After
    ``trainer.max_consecutive_skips`` skipped steps in a row the run stops with
    :class:`TrainingFailure`; the checkpoints already written stay as they are.

[Note: collective timeouts]
    The process group is created with ``trainer.collective_timeout_s``; a collective that waits
    longer for a rank that stopped participating raises in the ranks still running. The loop
    knows which phase of the step it is in (``Trainer.phase``) and turns that exception into a
    :class:`TrainingFailure` naming the phase and the collectives it runs.

Fault injection for tests (environment variables, not config keys; documented in
docs/reliability.md):

- ``FP8SHARD_INJECT_NAN_STEPS``: steps (1-based, as numbered in metrics.jsonl) whose loss is
  multiplied by NaN before backward: ``3,4``, ``3-5``, ``all``; ``FP8SHARD_INJECT_NAN_RANK``
  limits that to one rank (default: every rank).
- ``FP8SHARD_TEST_STALL_RANK`` (and ``FP8SHARD_TEST_STALL_STEP``, default 3): that rank sleeps
  forever at the start of that step.
- ``FP8SHARD_INJECT_KILL_STEP`` (``7``, or ``random:SEED`` for a step drawn from [1, max_steps]
  by a seeded generator) and ``FP8SHARD_INJECT_KILL_RANK`` (default 0): that rank SIGKILLs
  itself after the forward/backward of that step, before the optimizer step -- only on the
  first attempt of an elastic job (``TORCHELASTIC_RESTART_COUNT``, set by torchrun, is 0 or
  unset), so the restarted job runs through ([Note: elastic restart]).
- ``FP8SHARD_INJECT_SAVE_ERROR_STEPS`` (``4``, ``4,8``, ``all``), ``FP8SHARD_INJECT_SAVE_ERROR``
  (``ENOSPC``, the default, ``EACCES``, ``EIO`` or ``EROFS``) and ``FP8SHARD_INJECT_SAVE_ERROR_RANK``
  (default: every rank): the checkpoint save of that step fails on that rank with that
  ``OSError`` while DCP writes the shard file (after its first tensor), as a full disk or a
  read-only directory would ([Note: storage faults]).

[Note: elastic restart]
    Under ``torchrun --max-restarts K`` a rank that dies (SIGKILL, OOM killer, a lost node)
    makes torchrun stop the other ranks and start the whole worker group again, up to K times.
    Nothing in the loop handles this: ``trainer.resume=auto`` (the default) makes the new
    attempt load the newest complete checkpoint of the run directory, whose ``extra`` holds the
    data position, the log window, the counters and the LR schedule, and whose tensors hold
    every rank's RNG states ([Note: atomic checkpoints]: a save the kill interrupted is never
    taken for complete). At the same world size the restarted job is bit-identical to one that
    never failed (tests/reliability/test_elastic.py); the steps after the checkpoint are redone.

[Note: storage faults]
    A checkpoint save that fails (``OSError`` on any rank: disk full, permission denied, an I/O
    error) raises ``CheckpointSaveError`` on every rank: DCP gathers each rank's write result,
    and the fp8shard steps around it (``_together``) do the same, so no rank is left waiting.
    Nothing is published: the new checkpoint's temporary directory is removed (best effort) and
    the complete checkpoints, ``latest`` included, are not touched -- they are only ever
    changed after a new one was published. The loop then verifies the newest complete
    checkpoint (sizes and SHA-256 against its manifest) and, per ``checkpoint.on_save_error``,
    stops (``stop``, the default: one line, exit 1) or reports the failure, counts it
    (``checkpoint_save_errors``) and trains on (``continue``; the next scheduled save tries again).
    A failed save after the last step always stops: nothing would come after it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import sys
import time
from collections.abc import Iterator

NAN_STEPS_ENV = "FP8SHARD_INJECT_NAN_STEPS"
NAN_RANK_ENV = "FP8SHARD_INJECT_NAN_RANK"
STALL_RANK_ENV = "FP8SHARD_TEST_STALL_RANK"
STALL_STEP_ENV = "FP8SHARD_TEST_STALL_STEP"
KILL_STEP_ENV = "FP8SHARD_INJECT_KILL_STEP"
KILL_RANK_ENV = "FP8SHARD_INJECT_KILL_RANK"
SAVE_ERROR_STEPS_ENV = "FP8SHARD_INJECT_SAVE_ERROR_STEPS"
SAVE_ERROR_ENV = "FP8SHARD_INJECT_SAVE_ERROR"
SAVE_ERROR_RANK_ENV = "FP8SHARD_INJECT_SAVE_ERROR_RANK"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
SAVE_ERRNOS = {"ENOSPC": errno.ENOSPC, "EACCES": errno.EACCES, "EIO": errno.EIO, "EROFS": errno.EROFS}


class TrainingFailure(RuntimeError):
    """The run cannot go on; the message (one line) says why. The command exits with 1.

    ``every_rank``: each rank that raises it says so (ranks saw different things, e.g. which
    collective timed out); otherwise the ranks agree and rank 0 alone prints it."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


def parse_steps(text: str) -> set[int] | None:
    """``'3,4'`` -> {3, 4}; ``'3-5'`` -> {3, 4, 5}; ``'all'`` -> None (every step); '' -> set()."""
    text = text.strip()
    if text.lower() in ("all", "*"):
        return None
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        steps.update(range(int(lo), int(hi or lo) + 1))
    return steps


def _optional_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value else None


class FaultInjector:
    """Reads the injection variables once; ``nan_at``, ``maybe_stall``, ``maybe_kill`` and
    ``save_fault`` are called by the loop at the points where they inject."""

    def __init__(self) -> None:
        self.nan_steps = parse_steps(os.environ.get(NAN_STEPS_ENV, ""))
        self.nan_rank = _optional_int(NAN_RANK_ENV)
        self.stall_rank = _optional_int(STALL_RANK_ENV)
        self.stall_step = int(os.environ.get(STALL_STEP_ENV, "3"))
        self.kill_step_spec = os.environ.get(KILL_STEP_ENV, "").strip()
        self.kill_rank = _optional_int(KILL_RANK_ENV) or 0
        self.restart_count = int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)
        self.save_error_steps = parse_steps(os.environ.get(SAVE_ERROR_STEPS_ENV, ""))
        name = os.environ.get(SAVE_ERROR_ENV, "ENOSPC").strip().upper() or "ENOSPC"
        if name not in SAVE_ERRNOS:
            raise ValueError(f"{SAVE_ERROR_ENV}={name!r}: choose one of {', '.join(SAVE_ERRNOS)}")
        self.save_errno = SAVE_ERRNOS[name]
        self.save_error_rank = _optional_int(SAVE_ERROR_RANK_ENV)

    def nan_at(self, step: int, rank: int) -> bool:
        if self.nan_rank is not None and rank != self.nan_rank:
            return False
        return self.nan_steps is None or step in self.nan_steps

    def maybe_stall(self, step: int, rank: int) -> None:
        if self.stall_rank == rank and step == self.stall_step:
            while True:  # a rank that stopped participating (killed by the launcher at the end)
                time.sleep(3600)

    def kill_step(self, max_steps: int) -> int | None:
        """The step ``FP8SHARD_INJECT_KILL_STEP`` names (``random:SEED``: drawn in [1, max_steps])."""
        spec = self.kill_step_spec
        if not spec:
            return None
        if spec.lower().startswith("random"):
            _, _, seed = spec.partition(":")
            return random.Random(int(seed or 0)).randint(1, max_steps)
        return int(spec)

    def maybe_kill(self, step: int, rank: int, max_steps: int) -> None:
        """SIGKILL this process at ``step``, on an elastic job's first attempt only ([Note: elastic
        restart])."""
        if rank != self.kill_rank or self.restart_count != 0 or self.kill_step(max_steps) != step:
            return
        print(f"fp8shard.train: injected fault: SIGKILL of rank {rank} at step {step} "
              f"({KILL_STEP_ENV}, attempt {self.restart_count})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def save_fault(self, step: int, rank: int) -> Iterator[None]:
        """Inside: the checkpoint save of ``step`` fails with the configured ``OSError`` on this
        rank while DCP writes the shard file (after its first tensor), as a full disk would."""
        steps = self.save_error_steps
        hit = (steps is None or step in steps) and self.save_error_rank in (None, rank)
        if not hit:
            yield
            return
        import torch.distributed.checkpoint.filesystem as dcp_fs

        code = self.save_errno
        orig = getattr(dcp_fs, "_write_item", None)

        def fail(path: object = None) -> OSError:
            return OSError(code, f"{os.strerror(code)} (injected: {SAVE_ERROR_STEPS_ENV})", path)

        if orig is None:  # torch moved it: fail before writing instead
            raise fail()

        def write_item(transforms: object, stream: object, *args: object, **kwargs: object) -> object:
            orig(transforms, stream, *args, **kwargs)  # part of the shard file is on disk
            raise fail(getattr(stream, "name", None))

        dcp_fs._write_item = write_item
        try:
            yield
        finally:
            dcp_fs._write_item = orig


def is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def is_peer_lost(e: BaseException) -> bool:
    """A collective failed because another rank's process went away (killed, crashed)."""
    text = str(e).lower()
    return any(k in text for k in ("connection reset by peer", "connection closed by peer", "broken pipe",
                                   "connection refused"))

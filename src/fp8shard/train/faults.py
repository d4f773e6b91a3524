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

Fault injection for tests: the loop calls a :class:`FaultHooks` object at the points where a
fault can be injected; the production default does nothing. Tests pass
``fp8shard.testing.faults.Faults`` (NaN losses, a stalled rank, a SIGKILLed rank, a failing
checkpoint save; docs/reliability.md) to ``Trainer(cfg, env, faults=...)``, or run
``python -m fp8shard.testing.faults --faults '<json>' <train args>`` under torchrun.

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
from collections.abc import Iterator


class TrainingFailure(RuntimeError):
    """The run cannot go on; the message (one line) says why. The command exits with 1.

    ``every_rank``: each rank that raises it says so (ranks saw different things, e.g. which
    collective timed out); otherwise the ranks agree and rank 0 alone prints it."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class FaultHooks:
    """Where the training loop lets a test inject a fault; every hook does nothing here.

    ``step`` is 1-based, as numbered in metrics.jsonl; ``rank`` is this process's rank."""

    def maybe_stall(self, step: int, rank: int) -> None:
        """At the start of ``step``: a test may make this rank stop participating."""

    def nan_at(self, step: int, rank: int) -> bool:
        """Whether this rank's losses of ``step`` are multiplied by NaN before backward."""
        return False

    def maybe_kill(self, step: int, rank: int, max_steps: int) -> None:
        """After the forward/backward of ``step``, before the optimizer step: a test may end
        this process here, its peers waiting in a collective."""

    @contextlib.contextmanager
    def save_fault(self, step: int, rank: int) -> Iterator[None]:
        """Around the checkpoint save of ``step``: a test may make it fail with an ``OSError``."""
        yield


def is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def is_peer_lost(e: BaseException) -> bool:
    """A collective failed because another rank's process went away (killed, crashed)."""
    text = str(e).lower()
    return any(k in text for k in ("connection reset by peer", "connection closed by peer", "broken pipe",
                                   "connection refused"))

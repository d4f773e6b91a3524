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
"""

from __future__ import annotations

import os
import time

NAN_STEPS_ENV = "FP8SHARD_INJECT_NAN_STEPS"
NAN_RANK_ENV = "FP8SHARD_INJECT_NAN_RANK"
STALL_RANK_ENV = "FP8SHARD_TEST_STALL_RANK"
STALL_STEP_ENV = "FP8SHARD_TEST_STALL_STEP"


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


class FaultInjector:
    """Reads the injection variables once; ``nan_at(step, rank)`` and ``maybe_stall(step, rank)``."""

    def __init__(self) -> None:
        self.nan_steps = parse_steps(os.environ.get(NAN_STEPS_ENV, ""))
        nan_rank = os.environ.get(NAN_RANK_ENV, "")
        self.nan_rank = int(nan_rank) if nan_rank.strip() else None
        rank = os.environ.get(STALL_RANK_ENV, "")
        self.stall_rank = int(rank) if rank.strip() else None
        self.stall_step = int(os.environ.get(STALL_STEP_ENV, "3"))

    def nan_at(self, step: int, rank: int) -> bool:
        if self.nan_rank is not None and rank != self.nan_rank:
            return False
        return self.nan_steps is None or step in self.nan_steps

    def maybe_stall(self, step: int, rank: int) -> None:
        if self.stall_rank == rank and step == self.stall_step:
            while True:  # a rank that stopped participating (killed by the launcher at the end)
                time.sleep(3600)


def is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text

"""Faults the tests inject into a training run: a ``FaultHooks`` that does something.

In one process, pass the object to the loop::

    Trainer(cfg, env, faults=Faults(nan_steps="3,4"))

For a subprocess or a torchrun job, run the training command through this module, which builds
the object from JSON (the field names below) and then runs ``python -m fp8shard.train``::

    torchrun --nproc-per-node 2 -m fp8shard.testing.faults \\
        --faults '{"kill_step": "random:5", "kill_rank": 1}' trainer.max_steps=12 ...

The faults (steps are 1-based, as numbered in metrics.jsonl; ``None`` ranks mean every rank):

- ``nan_steps`` (``"3,4"``, ``"3-5"``, ``"all"``, or a list of steps): this rank's losses of
  those steps are multiplied by NaN before backward; ``nan_rank`` limits it to one rank.
- ``stall_rank`` (and ``stall_step``, default 3): that rank sleeps forever at the start of that
  step, a rank that stopped participating ([Note: collective timeouts]).
- ``kill_step`` (``7``, or ``"random:SEED"`` for a step drawn from [1, max_steps] by a seeded
  generator) and ``kill_rank`` (default 0): that rank SIGKILLs itself after the forward/backward
  of that step, before the optimizer step -- only on the first attempt of an elastic job
  (``TORCHELASTIC_RESTART_COUNT``, set by torchrun, is 0 or unset), so the restarted job runs
  through ([Note: elastic restart]).
- ``save_error_steps`` (``"4"``, ``"4,8"``, ``"all"``), ``save_error`` (``ENOSPC``, the
  default, ``EACCES``, ``EIO`` or ``EROFS``) and ``save_error_rank``: the checkpoint save of that
  step fails on that rank with that ``OSError`` while DCP writes the shard file (after its first
  tensor), as a full disk or a read-only directory would ([Note: storage faults]).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator

from fp8shard.train.faults import FaultHooks

SAVE_ERRNOS = {"ENOSPC": errno.ENOSPC, "EACCES": errno.EACCES, "EIO": errno.EIO, "EROFS": errno.EROFS}
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun: which attempt this is


def parse_steps(spec: str | int | list[int] | None) -> set[int] | None:
    """``'3,4'`` -> {3, 4}; ``'3-5'`` -> {3, 4, 5}; ``'all'`` -> None (every step); ''/None -> set()."""
    if spec is None:
        return set()
    if isinstance(spec, int) and not isinstance(spec, bool):
        return {spec}
    if isinstance(spec, (list, tuple, set)):
        return {int(s) for s in spec}
    text = str(spec).strip()
    if text.lower() in ("all", "*"):
        return None
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            steps.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"steps {spec!r}: write them as '3,4', '3-5' or 'all'") from None
    return steps


@dataclasses.dataclass
class Faults(FaultHooks):
    """The faults to inject (see the module docstring); the defaults inject none."""

    nan_steps: str | int | list[int] | None = None
    nan_rank: int | None = None
    stall_rank: int | None = None
    stall_step: int = 3
    kill_step: int | str | None = None
    kill_rank: int = 0
    save_error_steps: str | int | list[int] | None = None
    save_error: str = "ENOSPC"
    save_error_rank: int | None = None

    def __post_init__(self) -> None:
        self._nan = parse_steps(self.nan_steps)
        self._save = parse_steps(self.save_error_steps)
        name = str(self.save_error).strip().upper()
        if name not in SAVE_ERRNOS:
            raise ValueError(f"save_error={self.save_error!r}: choose one of {', '.join(SAVE_ERRNOS)}")
        self._errno = SAVE_ERRNOS[name]
        self.kill_step_of(1)  # a malformed kill_step is an error now, not at the step

    @classmethod
    def from_json(cls, text: str) -> Faults:
        """``Faults(**json.loads(text))``, with a clear error for bad JSON or an unknown field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--faults is not valid JSON ({e.msg}): {text!r}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--faults must be a JSON object, e.g. '{{\"nan_steps\": \"3,4\"}}', "
                             f"got {text!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"--faults: unknown field(s) {', '.join(unknown)}; the fields are: "
                             f"{', '.join(names)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    # ------------------------------------------------------------------ the hooks
    def maybe_stall(self, step: int, rank: int) -> None:
        if self.stall_rank == rank and step == self.stall_step:
            while True:  # a rank that stopped participating (killed by the launcher at the end)
                time.sleep(3600)

    def nan_at(self, step: int, rank: int) -> bool:
        if self.nan_rank is not None and rank != self.nan_rank:
            return False
        return self._nan is None or step in self._nan

    def kill_step_of(self, max_steps: int) -> int | None:
        """The step ``kill_step`` names (``random:SEED``: drawn in [1, max_steps])."""
        spec = self.kill_step
        if spec is None or spec == "":
            return None
        text = str(spec).strip()
        try:
            if text.lower().startswith("random"):
                _, _, seed = text.partition(":")
                return random.Random(int(seed or 0)).randint(1, max_steps)
            return int(text)
        except ValueError:
            raise ValueError(f"kill_step={spec!r}: give a step (7) or random:SEED") from None

    def maybe_kill(self, step: int, rank: int, max_steps: int) -> None:
        """SIGKILL this process at ``step``, on an elastic job's first attempt only ([Note: elastic
        restart])."""
        attempt = int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)
        if rank != self.kill_rank or attempt != 0 or self.kill_step_of(max_steps) != step:
            return
        print(f"fp8shard.train: injected fault: SIGKILL of rank {rank} at step {step} "
              f"(kill_step, attempt {attempt})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def save_fault(self, step: int, rank: int) -> Iterator[None]:
        """Inside: the checkpoint save of ``step`` fails with the configured ``OSError`` on this
        rank while DCP writes the shard file (after its first tensor), as a full disk would."""
        hit = (self._save is None or step in self._save) and self.save_error_rank in (None, rank)
        if not hit:
            yield
            return
        import torch.distributed.checkpoint.filesystem as dcp_fs

        code = self._errno
        orig = getattr(dcp_fs, "_write_item", None)

        def fail(path: object = None) -> OSError:
            return OSError(code, f"{os.strerror(code)} (injected: save_error_steps)", path)

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


def command(faults: Faults, launcher: list[str] | None = None) -> list[str]:
    """The argv start that runs the training command with ``faults``: ``[python, -m,
    fp8shard.testing.faults, --faults, JSON]``, or after ``launcher`` (torchrun's argv up to ``-m``)."""
    head = launcher if launcher is not None else [sys.executable]
    return [*head, "-m", "fp8shard.testing.faults", "--faults", faults.to_json()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m fp8shard.testing.faults",
        description="Run `python -m fp8shard.train` with injected faults (tests only).")
    parser.add_argument("--faults", required=True, help="JSON object of Faults fields")
    args, train_args = parser.parse_known_args(argv)
    try:
        faults = Faults.from_json(args.faults)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    from fp8shard.train.__main__ import main as train_main

    return train_main(train_args, faults=faults)


__all__ = ["SAVE_ERRNOS", "FaultHooks", "Faults", "command", "main", "parse_steps"]


if __name__ == "__main__":
    sys.exit(main())

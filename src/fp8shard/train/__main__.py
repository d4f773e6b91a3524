"""``python -m fp8shard.train [config=PRESET] [key=value ...]``, or under ``torchrun``.

A configuration problem prints one message naming the key (no traceback) and exits with 2, as
does a run directory another job holds (every rank says so); a run that cannot go on (too many
skipped steps in a row, a collective that timed out, a data file changed under it) prints one
message naming the cause and exits with 1; SIGINT or SIGTERM stops every rank with one line and
exits with 128 + the signal number ([Note: signals] in interrupt.py; docs/reliability.md).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from fp8shard.train.config import ConfigError, help_text, load_config
from fp8shard.train.interrupt import Interrupted, handle_signals, received

if TYPE_CHECKING:
    from fp8shard.train.faults import FaultHooks


def _error(message: str) -> int:
    if os.environ.get("RANK", "0") == "0":  # under torchrun, say it once
        print(f"fp8shard.train: error: {message}", file=sys.stderr)
        print("run `python -m fp8shard.train --help` for every key and its choices", file=sys.stderr)
    return 2


def _failure(message: str, every_rank: bool) -> int:
    """The run could not go on: rank 0 says why (or every rank that saw it, ``every_rank``)."""
    rank = os.environ.get("RANK", "0")
    if rank == "0" or every_rank:
        where = "" if "WORLD_SIZE" not in os.environ else f" (rank {rank})"
        print(f"fp8shard.train: error{where}: {message}", file=sys.stderr, flush=True)
    return 1


def _rank_line(message: str, env: Any) -> None:
    """One line from this rank (every rank prints its own)."""
    where = "" if env is None or env.world_size == 1 else f" (rank {env.rank})"
    print(f"fp8shard.train: {message.replace('{where}', where)}", file=sys.stderr, flush=True)


def _signalled() -> None:
    """Raise Interrupted if a stop signal arrived: an error that followed it (a peer that the
    signal ended, a save it interrupted) is its consequence, not the cause to report."""
    signum = received()
    if signum is not None:
        raise Interrupted(signum)


def _interrupted(e: Interrupted, env: Any, trainer: Any) -> int:
    """A stop signal ([Note: signals]): tidy up, one line on this rank, 128 + the signal number."""
    at = " during start-up"
    kept = ""
    if trainer is not None:
        trainer.close()  # idempotent: partial saves removed, lock released (rank 0)
        at = f" at step {trainer.step}"
        from fp8shard.checkpoint import list_checkpoints

        found = list_checkpoints(trainer.ckpt_root)
        kept = (f"; the newest complete checkpoint {found[0]} is kept: run the same command to resume"
                if found else "; no checkpoint was written")
    _rank_line(f"stopped by {e.name}{{where}}{at}{kept}", env)
    return e.exit_code


def main(argv: list[str] | None = None, faults: FaultHooks | None = None) -> int:
    """Run the training command on ``argv``; ``faults``: the loop's fault hooks (tests inject
    faults through them, ``fp8shard.testing.faults``; none by default)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(help_text())
        return 0
    state: dict[str, Any] = {"env": None, "trainer": None}
    with handle_signals():
        try:
            code = _run(argv, state, faults)
        except Interrupted as e:
            code = _interrupted(e, state["env"], state["trainer"])
        except BaseException:
            signum = received()
            if signum is None:
                raise
            # The Interrupted was caught on the way (DCP wraps what its steps raise) and another
            # error surfaced instead: the signal is what stopped the run.
            code = _interrupted(Interrupted(signum), state["env"], state["trainer"])
    env = state["env"]
    if env is not None and env.backend is not None:
        # Leave without running destructors: at interpreter exit DDP's reducer can free the gloo
        # process group, whose destructor joins gloo's worker thread while holding the GIL, and
        # that thread may need the GIL to free a finished work's tensors -- a deadlock seen at
        # the end of 2-rank CPU runs. Every file is closed and the output flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(argv: list[str], state: dict[str, Any], faults: FaultHooks | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        return _error(str(e))

    from fp8shard.train.distributed import init_distributed, teardown
    from fp8shard.train.loop import Trainer, TrainingFailure
    from fp8shard.train.report_hook import draw_plots
    from fp8shard.train.rundir import RunDirInUse

    try:
        env = state["env"] = init_distributed(cfg.trainer.accelerator, cfg.trainer.collective_timeout_s)
    except ConfigError as e:  # e.g. more ranks than GPUs: one line, before NCCL
        return _error(str(e))
    code = 0
    try:
        trainer = state["trainer"] = Trainer(cfg, env, faults=faults)
        trainer.fit()
        if env.is_main and cfg.exp_manager.plots:
            draw_plots(trainer.run_dir)
    except ConfigError as e:  # problems only the data can reveal (e.g. a too-short file)
        _signalled()
        code = _error(str(e))
    except RunDirInUse as e:  # every rank learnt it from rank 0: each says so once
        _signalled()
        _rank_line(f"error{{where}}: {e}", env)
        code = 2
    except TrainingFailure as e:  # the ranks may disagree on where they are: no barrier
        if "another rank is gone" in str(e) and env.backend is not None:
            time.sleep(0.5)  # torchrun stopping the job signals every rank: say that instead
        _signalled()
        code = _failure(str(e), e.every_rank)  # a timed-out group may not destroy cleanly: leave without it
    except Interrupted:
        raise
    except BaseException:
        _signalled()
        teardown(env, wait=False)  # the other ranks may never arrive: no barrier
        raise
    finally:
        trainer = state["trainer"]
        if trainer is not None:
            trainer.close()
    if code != 1:
        teardown(env, wait=code == 0)
    return code


if __name__ == "__main__":
    sys.exit(main())

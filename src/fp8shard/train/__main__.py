"""``python -m fp8shard.train [config=PRESET] [key=value ...]``, or under ``torchrun``.

A configuration problem prints one message naming the key (no traceback) and exits with 2, as
does a run directory another job holds (every rank says so); a run that cannot go on
(too many skipped steps in a row, a collective that timed out) prints one
message naming the cause and exits with 1 (docs/reliability.md).
"""

from __future__ import annotations

import os
import sys

from fp8shard.train.config import ConfigError, help_text, load_config


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        return _error(str(e))

    from fp8shard.train.distributed import init_distributed, teardown
    from fp8shard.train.loop import Trainer, TrainingFailure
    from fp8shard.train.report_hook import draw_plots
    from fp8shard.train.rundir import RunDirInUse

    env = init_distributed(cfg.trainer.accelerator, cfg.trainer.collective_timeout_s)
    code = 0
    trainer = None
    try:
        trainer = Trainer(cfg, env)
        trainer.fit()
        if env.is_main and cfg.exp_manager.plots:
            draw_plots(trainer.run_dir)
    except ConfigError as e:  # problems only the data can reveal (e.g. a too-short file)
        code = _error(str(e))
    except RunDirInUse as e:  # every rank learnt it from rank 0: each says so once
        where = "" if env.world_size == 1 else f" (rank {env.rank})"
        print(f"fp8shard.train: error{where}: {e}", file=sys.stderr, flush=True)
        code = 2
    except TrainingFailure as e:  # the ranks may disagree on where they are: no barrier
        code = _failure(str(e), e.every_rank)  # a timed-out group may not destroy cleanly: leave without it
    except BaseException:
        teardown(env, wait=False)  # the other ranks may never arrive: no barrier
        raise
    finally:
        if trainer is not None:
            trainer.close()  # the run directory's lock
    if code != 1:
        teardown(env, wait=code == 0)
    if env.backend is not None:
        # Leave without running destructors: at interpreter exit DDP's reducer can free the gloo
        # process group, whose destructor joins gloo's worker thread while holding the GIL, and
        # that thread may need the GIL to free a finished work's tensors -- a deadlock seen at
        # the end of 2-rank CPU runs. Every file is closed and the output flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())

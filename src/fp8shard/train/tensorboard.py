"""``exp_manager.create_tensorboard_logger=true``: the logged scalars as TensorBoard events.

Events go into the run directory beside metrics.jsonl (``events.out.tfevents.*``, written by
``torch.utils.tensorboard.SummaryWriter``), so ``tensorboard --logdir runs`` shows every run
by name. Each numeric field of a metrics.jsonl record becomes a scalar at its step, under a
tag that groups it (``train/loss``, ``train/lr``, ``perf/tokens_per_s``, ``val/loss``,
``faults/skipped_steps`` ...); the bytes each collective moves per step (from the summary)
are written at the last step (``comm/...``, ``wire/...``).

A resumed run starts its events file with TensorBoard's purge marker at the first step it
redoes, so the steps after the checkpoint that the earlier process had logged are dropped from
the curves, as they are from metrics.jsonl.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fp8shard.train.config import ConfigError

TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "elapsed_s": "perf/elapsed_s", "tokens": "train/tokens",
    "consumed_samples": "train/consumed_samples", "start_step": "perf/start_step",
    "val_loss": "val/loss", "val_bpb": "val/bits_per_byte", "skipped": "faults/skipped",
    "skipped_steps": "faults/skipped_steps", "world_size": "perf/world_size",
}
"""Tag of each metrics.jsonl field; other numeric fields go under ``faults/`` (the counters)."""


def check_available() -> None:
    """A ConfigError naming the package when tensorboard is not installed (every rank calls it,
    so all stop the same way)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("exp_manager.create_tensorboard_logger=true needs the `tensorboard` package: "
                          "pip install tensorboard (or pip install 'fp8shard[tensorboard]'), or set "
                          "exp_manager.create_tensorboard_logger=false")


def tag_of(key: str) -> str:
    return TAGS.get(key, f"faults/{key}")


class TensorBoardLogger:
    """Scalars of metrics.jsonl records into ``run_dir`` (rank 0 only)."""

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step, flush_secs=30)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        wall = record.get("wall_time")
        for key, value in record.items():
            if key in ("step", "wall_time") or not isinstance(value, (int, float)):
                continue
            self.writer.add_scalar(tag_of(key), float(value), step, walltime=wall)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Bytes per optimizer step by collective, at the last step."""
        step = int(summary.get("steps", 0))
        for prefix, key in (("comm", "comm_bytes_per_step"), ("wire", "wire_bytes_per_step")):
            for name, value in sorted((summary.get(key) or {}).items()):
                self.writer.add_scalar(f"{prefix}/{name}", float(value), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

"""What a run records: metrics.jsonl, summary.json, the progress line, memory and comm figures.

[Note: comm bytes]
    Bytes per collective are the size of the collective's full buffer on one rank (the input of
    a reduce-scatter, the gathered output of an all-gather, the tensor of an all-reduce): the
    convention of ``DistributedFusedAdam.comm_report()``. For adamw + DDP the figures are
    counted the same way: DDP all-reduces every gradient once per optimizer step, so
    ``all_reduce.grads`` = the gradient bytes. ``wire_bytes_per_step`` converts to what a ring
    algorithm sends from each rank: (N-1)/N of a reduce-scatter or all-gather buffer and
    2(N-1)/N of an all-reduce buffer. One process sends nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fp8shard.train.faults import TrainingFailure

MEMORY_CATEGORIES = ("weights", "grads", "master", "optimizer_states", "padding")


def wire_bytes(comm: dict[str, int], world_size: int) -> dict[str, float]:
    """Bytes each rank sends per collective kind under a ring algorithm; see [Note: comm bytes]."""
    if world_size <= 1:
        return dict.fromkeys(comm, 0.0)
    f = (world_size - 1) / world_size
    return {k: v * (2 * f if k.startswith("all_reduce") else f) for k, v in comm.items()}


def bytes_per_param(memory: dict[str, int], num_params: int) -> dict[str, float]:
    return {k: round(v / num_params, 4) for k, v in memory.items()}


def peak_memory() -> tuple[int, str]:
    """(bytes, what was measured): CUDA max allocated, or this process's max RSS on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "cpu_max_rss"


def _fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _fmt_rate(r: float) -> str:
    return f"{r / 1e6:.2f}M" if r >= 1e6 else f"{r / 1e3:.1f}k"


class RunFileError(TrainingFailure):
    """Writing a file of the run directory failed (disk full, permission denied, quota): one
    line naming the file and the cause. Checkpoints are written apart from these files, so the
    ones already complete stay loadable and a rerun resumes from the newest."""

    def __init__(self, path: Path, error: OSError) -> None:
        reason = f"[Errno {error.errno}] {error.strerror}" if error.strerror else str(error)
        super().__init__(f"writing {path} failed: {reason}; complete checkpoints are unaffected: "
                         f"make room (or fix the permissions) and rerun the same command, which "
                         f"resumes from the newest one (trainer.resume=auto)")
        self.path, self.error = path, error


class RunRecorder:
    """Writes the run directory's files; only rank 0 writes or prints (``enabled``).

    Any ``OSError`` while writing one of them is raised as ``RunFileError`` ([Note: storage
    faults] in checkpoint/io.py: the metrics file gets the same one-line treatment)."""

    def __init__(self, run_dir: Path, enabled: bool, max_steps: int, keep_until: int | None = None,
                 tensorboard: bool = False) -> None:
        """``keep_until``: resuming at that step, keep metrics.jsonl's records up to it and append
        (the records of steps after the checkpoint are redone by the resumed run). ``tensorboard``:
        also write the records as TensorBoard events (train/tensorboard.py)."""
        self.run_dir, self.enabled, self.max_steps = run_dir, enabled, max_steps
        self.start = time.perf_counter()
        self.start_step = keep_until or 0
        """The step this process started from (a resume's checkpoint): ``start_step`` of its records."""
        self._file = None
        self._tb: Any = None
        if tensorboard:
            from fp8shard.train.tensorboard import TensorBoardLogger, check_available

            check_available()  # on every rank: all stop alike when it is missing
            if enabled:
                with self._writing(run_dir):
                    run_dir.mkdir(parents=True, exist_ok=True)
                    self._tb = TensorBoardLogger(run_dir, None if keep_until is None else keep_until + 1)
        self.metrics_path = run_dir / "metrics.jsonl"
        if enabled:
            path = self.metrics_path
            with self._writing(path):
                run_dir.mkdir(parents=True, exist_ok=True)
                kept = []
                if keep_until is not None and path.exists():
                    for line in path.read_text().splitlines():
                        try:
                            if json.loads(line)["step"] <= keep_until:
                                kept.append(line + "\n")
                        except (ValueError, KeyError, TypeError):
                            break  # a line cut by a crash ends what can be kept
                # The kept records go to a new file renamed over the old one, so a signal or a
                # crash here leaves the old file whole, never one cut short ([Note: signals]).
                tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
                with tmp.open("w") as f:
                    f.writelines(kept)
                os.replace(tmp, path)
                self._file = path.open("a")

    @staticmethod
    @contextlib.contextmanager
    def _writing(path: Path) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            raise RunFileError(path, e) from e

    def write_config(self, text: str) -> None:
        if self.enabled:
            path = self.run_dir / "config.yaml"
            with self._writing(path):
                path.write_text(text)

    def log(self, record: dict[str, Any]) -> None:
        """Append one JSON object to metrics.jsonl (flushed, so a crashed run keeps its lines),
        with ``start_step``: where this process began (the report tells resumes apart by it)."""
        record = {**record, "start_step": self.start_step}
        if self._file is not None:
            with self._writing(self.metrics_path):
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
        if self._tb is not None:
            self._tb.log(record)

    def sync(self) -> None:
        """Flush metrics.jsonl and fsync it (at checkpoints: the records up to one are on disk)."""
        if self._file is not None:
            with self._writing(self.metrics_path):
                self._file.flush()
                os.fsync(self._file.fileno())
        if self._tb is not None:
            self._tb.flush()

    def progress(self, step: int, loss: float, tokens_per_s: float, lr: float, extra: str = "") -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (self.max_steps - step) if step else float("nan")
        width = 20
        done = int(width * step / self.max_steps)
        bar = "#" * done + "." * (width - done)
        print(f"[{bar}] step {step:>5}/{self.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
              f"{_fmt_rate(tokens_per_s)} tok/s | elapsed {_fmt_time(elapsed)} | ETA {_fmt_time(eta)}"
              f"{extra}", flush=True)

    def say(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        if self.enabled:
            with self._writing(path):
                path.write_text(json.dumps(summary, indent=2) + "\n")
        if self._tb is not None:
            self._tb.log_summary(summary)
            self._tb.close()
            self._tb = None
        return path

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()  # still open: the summary's figures follow
        if self._file is not None:
            f, self._file = self._file, None
            with self._writing(self.metrics_path):
                f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a last line cut short by a crash is left out.

    A damaged line anywhere else is an error (ValueError naming the line)."""
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                break  # the write of this line was interrupted
            raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
    return records


def format_summary(s: dict[str, Any]) -> str:
    """A few lines for the terminal at the end of a run."""
    lines = [f"run: {s['run_dir']}  ({s['world_size']} rank(s) on {s['device']}, optimizer "
             f"{s['optimizer']}, fp8={s['fp8']['fp8']} fp8_params={s['fp8']['fp8_params']})"]
    floor = s.get("entropy_floor")
    val = s.get("val_loss")
    text = f"final train loss {s['final_train_loss']:.4f}, validation loss {val:.4f}"
    if s.get("val_bpb") is not None:
        text += f" nats/token = {s['val_bpb']:.4f} bits/byte"
    if floor is not None:
        text += f", entropy floor {floor:.4f} (gap {val - floor:+.4f} nats, {100 * (val / floor - 1):.1f}%)"
    lines.append(text)
    lines.append(f"throughput {s['tokens_per_s']:.0f} tokens/s; peak memory "
                 f"{s['peak_memory_bytes'] / 2**20:.0f} MiB ({s['peak_memory_kind']}); "
                 f"{s['num_params']:,} parameters")
    bpp = s["bytes_per_param"]
    per_cat = ", ".join(f"{k} {bpp[k]:.2f}" for k in MEMORY_CATEGORIES if k in bpp)
    lines.append(f"bytes/param per rank: {per_cat}")
    comm = s["comm_bytes_per_step"]
    if comm:
        lines.append("comm bytes/step per rank: " + ", ".join(f"{k} {v:,}" for k, v in sorted(comm.items())))
    return "\n".join(lines)

"""Run the training command as a user would (a subprocess) and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from fp8shard.testing.faults import Faults
from fp8shard.testing.faults import command as fault_command

# A tiny GPT on a small slice of the default corpus: seconds per run on one CPU core.
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
    "model.ffn_hidden_size=256", "model.encoder_seq_length=64", "model.micro_batch_size=8",
    "model.global_batch_size=16", "data.num_train_tokens=300000", "data.num_val_tokens=20000",
    "trainer.limit_val_batches=4", "exp_manager.plots=false",
]


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment of a training subprocess in a CPU test: one thread per rank, no GPU (on a
    GPU machine the command would otherwise pick NCCL and need one GPU per rank)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
            **extra}


def train_command(nproc: int, faults: Faults | None = None) -> list[str]:
    """``python -m fp8shard.train`` or its torchrun; with ``faults``, through
    ``-m fp8shard.testing.faults --faults JSON`` (which runs the same command with them)."""
    launcher = [sys.executable]
    if nproc != 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}"]
    if faults is not None:
        return fault_command(faults, launcher)
    return [*launcher, "-m", "fp8shard.train"]


def run_train(run_dir: Path, overrides: list[str], nproc: int = 1, timeout: float = 300,
              check: bool = True, faults: Faults | None = None) -> subprocess.CompletedProcess:
    """``python -m fp8shard.train`` (or torchrun) writing to ``run_dir``; one thread per rank;
    ``faults``: injected (fp8shard.testing.faults).

    The command runs in its own session so a timeout ends torchrun and its workers together.
    """
    args = [*overrides, f"exp_manager.exp_dir={run_dir.parent}", f"exp_manager.name={run_dir.name}"]
    env = cpu_env()
    cmd = [*train_command(nproc, faults), *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            tail = f"{out[-3000:]}\n{err[-3000:]}"
            raise AssertionError(f"training timed out after {timeout}s:\n{tail}") from None
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def process_tree(pid: int) -> list[int]:
    """``pid``'s descendants, deepest first, then ``pid`` (Linux /proc). torchrun starts its
    ranks in sessions of their own, so killing its process group would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out[::-1]


def kill_pids(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` (those already gone are skipped)."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)

"""The one timer of the benchmark scripts: median seconds of a callable.

CUDA: device events around each call, after ``warmup`` untimed calls (compilation, autotuning
and allocator warm-up stay out of the numbers). CPU: ``time.perf_counter``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def median_seconds(fn: Callable[[], object], device: str = "cpu", warmup: int = 3, reps: int = 10) -> float:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_and_wall_seconds(fn: Callable[[], object], device: str = "cpu", warmup: int = 3,
                          reps: int = 10) -> tuple[float, float]:
    """(median host seconds, median wall seconds) of ``fn``: ``time.perf_counter`` from the call
    to its return (the host's work: Python, guards, launches; the device queue is drained before
    each call), and to the device's end of that work (CUDA: after a synchronize). On the CPU the
    two are the same time."""
    for _ in range(warmup):
        fn()
    host, wall = [], []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if device == "cuda":
            torch.cuda.synchronize()
        host.append(t1 - t0)
        wall.append((time.perf_counter() if device == "cuda" else t1) - t0)
    return statistics.median(host), statistics.median(wall)


def cuda_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (after a warm-up call, and one on a side stream as capture
    wants); replaying it times the GPU work alone, without host overhead."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def run_child(script: str, argv: list[str], name: str) -> dict[str, Any]:
    """Run ``script argv --child name`` in a fresh Python process and return the JSON object it
    prints last (a benchmark's arm measured in a process of its own)."""
    cmd = [sys.executable, os.path.abspath(script), *argv, "--child", name]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"arm {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """A benchmark's result as JSON at ``path`` (``--out``; nothing when None), and say where."""
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {path}")

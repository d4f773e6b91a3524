"""A pool of worker processes forming one process group, reused across many test cases.

Every distributed test uses this: start ``world_size`` workers once (per test module), then
``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank and returns the per-rank results.
Backend: gloo on CPU, NCCL when there is one GPU per rank (``backend="auto"``). Functions must
be importable (module-level) so the spawned workers can unpickle them.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def pick_backend(world_size: int, backend: str = "auto") -> str:
    if backend != "auto":
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


@dataclasses.dataclass
class _Failure:
    rank: int
    text: str


def _worker(rank: int, world_size: int, backend: str, init_file: str,
            tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, fn(*args, **kwargs)))
        except BaseException:  # report every failure to the parent, keep serving
            results.put((rank, _Failure(rank, traceback.format_exc())))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` processes in one process group; see the module docstring."""

    def __init__(self, world_size: int, backend: str = "auto", timeout_s: float = 300.0) -> None:
        self.world_size = world_size
        self.backend = pick_backend(world_size, backend)
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="fp8shard_pg_")
        os.close(fd)
        os.unlink(self._init_file)  # FileStore wants a path that does not exist yet
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, self.backend, self._init_file,
                                              self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        A rank that raises makes this raise ``RuntimeError`` with that rank's traceback.
        """
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: list[Any] = [None] * self.world_size
        failures = []
        name = getattr(fn, "__name__", fn)
        for _ in range(self.world_size):
            rank, value = self._next_result(name)
            if isinstance(value, _Failure):
                failures.append(value)
            out[rank] = value
        if failures:
            text = "\n".join(f"--- rank {f.rank} ---\n{f.text}" for f in failures)
            raise RuntimeError(f"{name} failed on {len(failures)} rank(s):\n{text}")
        return out

    def _next_result(self, name: object) -> tuple[int, Any]:
        """The next rank's result; a dead worker or ``timeout_s`` without one shuts the pool down
        and raises (a worker that died cannot answer: waiting for it would hang the suite)."""
        waited = 0.0
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                self.close(force=True)
                raise RuntimeError(f"{name}: worker process(es) of rank(s) {[r for r, _ in dead]} died "
                                   f"(exit codes {[c for _, c in dead]}); the pool was shut down")
            if waited >= self.timeout_s:
                self.close(force=True)
                raise TimeoutError(f"{name} did not finish on all {self.world_size} ranks within "
                                   f"{self.timeout_s}s; the pool was shut down")

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

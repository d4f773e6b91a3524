"""The optimizer's only calls into ``torch.distributed``, each one counted.

Keeping every collective here gives one place to read what goes on the wire (``CommCounter``
feeds ``DistributedFusedAdam.comm_report()``) and one place to adapt to a backend:

* gloo has no float8 dtype, so FP8 bytes travel as ``uint8`` views (NCCL takes uint8 too);
* a backend without ``ReduceOp.AVG`` for a dtype gets SUM followed by a division;
* without an initialized process group (a single process), every collective is the identity,
  so the optimizer also runs in a plain script with world size 1.

Byte counts are the size of the collective's full buffer on one rank (the gathered tensor of an
all-gather, the input of a reduce-scatter, the tensor of an all-reduce); a ring algorithm puts
``(N - 1) / N`` of that on each rank's link.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); 2.11 has only
# the old ones. Same arguments either way. Looked up at call time, so a harness that wraps
# torch.distributed's functions (benchmarks/compare_peers.py counts bytes that way) sees ours.
def _reduce_scatter(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _all_gather(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


@dataclasses.dataclass
class CommCounter:
    """Bytes and calls per collective kind, cumulative; ``window`` restarts per optimizer step."""

    total_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    total_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    window_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, kind: str, nbytes: int) -> None:
        self.total_bytes[kind] += nbytes
        self.total_calls[kind] += 1
        self.window_bytes[kind] += nbytes

    def close_window(self) -> dict[str, int]:
        done = dict(self.window_bytes)
        self.window_bytes = collections.Counter()
        return done


class Handle:
    """An in-flight collective; ``wait()`` finishes it (and any post-processing) once."""

    def __init__(self, work: dist.Work | None, after: Callable[[], None] | None = None) -> None:
        self._work = work
        self._after = after
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        if self._after is not None:
            self._after()
        self.done = True


class Group:
    """A process group with its rank and size, and the counted collectives over it."""

    def __init__(self, process_group: dist.ProcessGroup | None, counter: CommCounter) -> None:
        self.counter = counter
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            if process_group is not None:
                raise ValueError(
                    "a process_group was given but torch.distributed is not initialized; call "
                    "torch.distributed.init_process_group(...) first, or pass process_group=None "
                    "to run on one process"
                )
            self.pg, self.rank, self.world_size = None, 0, 1
            return
        self.pg = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(self.pg)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given "
                "process_group; build the optimizer only on the group's ranks, or pass the data-"
                "parallel group this rank belongs to"
            )
        self.rank, self.world_size = rank, dist.get_world_size(self.pg)
        self.backend = dist.get_backend(self.pg)
        self._avg_ok: dict[torch.dtype, bool] = {}

    @property
    def active(self) -> bool:
        """Whether collectives do anything (more than one rank)."""
        return self.distributed and self.world_size > 1

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, kind: str,
                           async_op: bool = True) -> Handle:
        """``out = mean over ranks of inp[rank-th slice]``; ``out`` may alias that slice."""
        self.counter.add(kind, inp.numel() * inp.element_size())
        if not self.active:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return Handle(None)
        if self._avg_ok.get(inp.dtype, True):
            try:
                work = _reduce_scatter(out, inp, op=dist.ReduceOp.AVG,
                                                  group=self.pg, async_op=async_op)
                self._avg_ok[inp.dtype] = True
                return Handle(work)
            except (RuntimeError, ValueError):
                self._avg_ok[inp.dtype] = False  # this backend: SUM, then divide
        work = _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=self.pg,
                                          async_op=async_op)
        return Handle(work, after=lambda: out.div_(self.world_size))

    def all_gather_inplace(self, buf: torch.Tensor, kind: str, async_op: bool = True) -> Handle:
        """Every rank's ``buf[rank-th slice]`` gathered into ``buf`` on every rank (in place)."""
        self.counter.add(kind, buf.numel() * buf.element_size())
        if not self.active:
            return Handle(None)
        n = buf.numel() // self.world_size
        mine = buf[self.rank * n:(self.rank + 1) * n]
        work = _all_gather(buf, mine, group=self.pg, async_op=async_op)
        return Handle(work)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, kind: str) -> None:
        """Blocking all-gather of ``inp`` from every rank into ``out`` (rank-major)."""
        self.counter.add(kind, out.numel() * out.element_size())
        if not self.active:
            out.copy_(inp)
            return
        _all_gather(out, inp, group=self.pg)

    def all_reduce(self, x: torch.Tensor, op: str, kind: str) -> torch.Tensor:
        """Blocking all-reduce in place; ``op`` is ``"max"`` or ``"sum"``."""
        self.counter.add(kind, x.numel() * x.element_size())
        if self.active:
            red = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op]
            dist.all_reduce(x, op=red, group=self.pg)
        return x

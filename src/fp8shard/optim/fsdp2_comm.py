"""Count the bytes FSDP2 all-gathers and reduce-scatters, by dtype, on this rank.

``count_fsdp_wire(model)`` installs a counting all-gather and reduce-scatter on every
``fully_shard``-ed module of ``model`` (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``, torch >= 2.8) and returns the ``WireCount`` they add to. Sizes
are the gathered (output) buffers and the reduce-scatter inputs per rank, as the flat engine's
``CommCounter`` counts them (a ring moves ``(N - 1) / N`` of them over each rank's link). The
counting costs one Python call per collective. ``FSDP2Adam(count_comm=True)`` uses it for
``comm_report()``; tests and benchmarks use it directly (``fp8shard.testing.fsdp_wire``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclasses.dataclass
class WireCount:
    """Bytes and calls of FSDP2's collectives, by (kind, dtype)."""

    bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    window: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, kind: str, t: torch.Tensor) -> None:
        key = f"{kind}.{str(t.dtype).removeprefix('torch.')}"
        self.bytes[key] += t.numel() * t.element_size()
        self.calls[key] += 1
        self.window[key] += t.numel() * t.element_size()

    def close_window(self) -> dict[str, int]:
        """Bytes by key since the last call (the optimizer closes it once per step)."""
        done = dict(self.window)
        self.window = collections.Counter()
        return done

    def total(self, kind: str) -> int:
        return sum(v for k, v in self.bytes.items() if k.startswith(kind + "."))

    def calls_total(self, kind: str) -> int:
        return sum(v for k, v in self.calls.items() if k.startswith(kind + "."))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.window.clear()


def _comm_classes() -> tuple[type, type]:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError as e:  # pragma: no cover - torch < 2.8
        raise RuntimeError("counting FSDP2's collectives needs torch >= 2.8 (set_custom_all_gather)") from e
    return DefaultAllGather, DefaultReduceScatter


def count_fsdp_wire(model: nn.Module) -> WireCount:
    """Install counting collectives on every FSDP2 module of ``model``; returns the counter."""
    from torch.distributed.fsdp import FSDPModule

    existing = model.__dict__.get("_fp8shard_wire_count")
    if isinstance(existing, WireCount):  # installed before: one counter per model
        return existing
    base_ag, base_rs = _comm_classes()
    count = WireCount()

    class CountingAllGather(base_ag):  # type: ignore[misc, valid-type]
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> Any:
            count.add("all_gather.params", output_tensor)
            # all_gather_into_tensor is in every torch with FSDP2 (2.13's default calls a newer alias)
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class CountingReduceScatter(base_rs):  # type: ignore[misc, valid-type]
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
            count.add("reduce_scatter.grads", input_tensor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    found = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(CountingAllGather())
            m.set_custom_reduce_scatter(CountingReduceScatter())
            found += 1
    if not found:
        raise ValueError("count_fsdp_wire: the model has no fully_shard-ed module; call "
                         "fully_shard_model(model, mesh) first")
    model.__dict__["_fp8shard_wire_count"] = count
    return count

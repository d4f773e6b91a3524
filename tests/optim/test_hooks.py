"""Gradient hooks: reduce-scatters start during backward, in one fixed order on every rank."""

from __future__ import annotations

import torch
from torch import nn

from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.collectives import Handle
from fp8shard.optim.flat import GradSync
from fp8shard.optim.layout import ParamSpec, build_layout
from tests.optim.dist_cases import TinyMixed, batch


class _RecordingGroup:
    """Stands in for collectives.Group: records which bucket each reduce-scatter was for."""

    def __init__(self, regions: list[RegionBuffers]) -> None:
        self.regions = regions
        self.launched: list[tuple[int, int]] = []

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, kind: str) -> Handle:
        for ri, rb in enumerate(self.regions):
            for b in rb.layout.buckets:
                if rb.bucket(rb.grad_buffer, b.index).data_ptr() == inp.data_ptr():
                    self.launched.append((ri, b.index))
        return Handle(None)


def _launch_order(arrival: list[int]) -> list[tuple[int, int]]:
    params = {i: nn.Parameter(torch.zeros(n)) for i, n in enumerate([5, 9, 3, 12])}
    specs = [ParamSpec(i, params[i].numel(), torch.float32) for i in reversed(range(4))]
    regions = [RegionBuffers(lay, 0, torch.device("cpu"), torch.float32, torch.float32)
               for lay in build_layout(specs, world_size=2, bucket_numel=8, alignment=1)]
    group = _RecordingGroup(regions)
    sync = GradSync(regions, params, group, overlap=True)  # type: ignore[arg-type]
    for i in arrival:
        params[i].grad = torch.ones_like(params[i])
        sync.accumulate(i, params[i])
        assert params[i].grad is None  # freed once it is in the bucket
    return group.launched


def test_buckets_launch_in_one_order_whatever_the_arrival_order():
    backward_order = _launch_order([3, 2, 1, 0])
    assert len(backward_order) == len(set(backward_order)) == 4  # 29 elements -> 30 -> 4 buckets
    assert _launch_order([0, 1, 2, 3]) == backward_order
    assert _launch_order([2, 0, 3, 1]) == backward_order


def test_reduce_scatters_start_during_backward():
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=64 * 2 / 2**20)
    model(batch(1, 0)).square().mean().backward()
    # Every bucket without an unused parameter, up to the first with one, was launched.
    sync = opt.engine.grad_sync
    assert sync.handles
    assert len(sync.handles) < len(sync.order)  # the unused ones wait for step()
    opt.step()

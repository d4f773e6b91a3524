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


def _grad_sync(shapes, grad_dtype, **layout):
    """Zero parameters of ``shapes``, laid out in reverse (as the backward reaches them), their
    regions on rank 0 and a ``GradSync`` over a recording group."""
    params = {i: nn.Parameter(torch.zeros(s)) for i, s in enumerate(shapes)}
    specs = [ParamSpec(i, params[i].numel(), torch.float32) for i in reversed(range(len(shapes)))]
    regions = [RegionBuffers(lay, 0, torch.device("cpu"), grad_dtype, torch.float32)
               for lay in build_layout(specs, **layout)]
    return params, regions, GradSync(regions, params, _RecordingGroup(regions), overlap=True)  # type: ignore[arg-type]


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


def test_lazy_zeroing_gives_the_bits_of_zero_then_add():
    """[Note: lazy gradient zeroing]: after a window that filled every slot, the next window's
    buffers (what its reduce-scatters read) are bit for bit what zeroing then adding gives: first
    gradients written over stale slots (-0.0 as +0.0, as 0 + -0.0 is), a micro-batch's added to
    them, a parameter without a gradient zeroed when its bucket launches, padding still zero."""
    sizes = [5, 9, 3, 12]
    params, regions, sync = _grad_sync([(n,) for n in sizes], torch.float32, world_size=2, bucket_numel=8,
                                       alignment=4)
    gen = torch.Generator().manual_seed(0)

    def arrive(i: int, g: torch.Tensor) -> None:
        params[i].grad = g.clone()
        sync.accumulate(i, params[i])

    for i, n in enumerate(sizes):  # window 1: every slot (and nothing else) written
        arrive(i, torch.randn(n, generator=gen) + 5)
    sync.finish()
    sync.reset()
    # Window 2: p0 in two micro-batches, p1 a gradient of -0.0 and 1.5, p2 none, p3 once.
    expected = [torch.zeros(rb.layout.numel) for rb in regions]  # the buffers are released now
    g0a, g0b = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    g3 = torch.randn(12, generator=gen)
    g1 = torch.tensor([-0.0, 1.5, -0.0, 2.0, 0.0, -3.0, -0.0, 1.0, 4.0])
    with torch.no_grad():
        for i, g in [(0, g0a), (0, g0b), (1, g1), (3, g3)]:
            ri = sync.where[i][0]
            r = regions[ri].ranges[i]
            expected[ri][r.start:r.end].add_(g)
    sync.enabled = False
    arrive(0, g0a)
    sync.enabled = True
    arrive(0, g0b)
    arrive(1, g1)
    arrive(3, g3)
    assert 2 in sync.stale  # not written yet: its slot holds whatever the new storage held
    sync.finish()
    assert not sync.stale
    for rb, want in zip(regions, expected, strict=True):
        assert torch.equal(rb.grad_buffer.view(torch.int32), want.view(torch.int32))
    assert any(rb.layout.numel > rb.layout.param_numel for rb in regions)  # padding was checked


def test_strided_and_cast_gradients_land_in_row_major_order():
    """A gradient arrives as autograd made it: a transposed (non-contiguous) 2-D tensor, in
    another dtype than the bucket's, or still attached to a graph (``create_graph``). Each slot,
    shaped as its parameter, receives the gradient's values in the parameter's row-major order,
    cast to the bucket's dtype, with the bits of zero then add; the bucket keeps no graph."""
    shapes = [(3, 5), (4, 2), (6,)]
    params, regions, sync = _grad_sync(shapes, torch.bfloat16, world_size=1, bucket_numel=64, alignment=1)
    gen = torch.Generator().manual_seed(0)
    g0 = torch.randn(5, 3, generator=gen).t()  # (3, 5), not contiguous
    g1a, g1b = torch.randn(4, 2, generator=gen), torch.randn(2, 4, generator=gen).t()
    w = torch.randn(6, generator=gen, requires_grad=True)
    g2 = w * 2  # attached to a graph, as under create_graph=True
    sync.enabled = False
    params[1].grad = g1a
    sync.accumulate(1, params[1])
    sync.enabled = True
    for i, g in [(0, g0), (1, g1b), (2, g2)]:
        params[i].grad = g
        sync.accumulate(i, params[i])
        assert params[i].grad is None
    rb = regions[0]
    expect = {0: g0.contiguous().reshape(-1).to(torch.bfloat16),
              1: (torch.add(g1a.reshape(-1).to(torch.bfloat16), 0).float()
                  + g1b.contiguous().reshape(-1)).to(torch.bfloat16),  # added in fp32, then rounded
              2: g2.detach().reshape(-1).to(torch.bfloat16)}
    for i, want in expect.items():
        r = rb.ranges[i]
        got = rb.grad_buffer[r.start:r.end]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), i
    assert not rb.grad_buffer.requires_grad and rb.grad_buffer.grad_fn is None

"""[Note: gradient regions] (optim/buffers.py): the gradient storage lives from the backward to the step.

A region's gradient buffer is allocated when the backward first reaches one of its parameters
(its padding zeroed), and dropped, with every view of it, when the gradients are consumed; the
regions are capped so that the backward allocates them one after another. Training with many
regions is training with one, bit for bit, on either step kernel (CPU here, the Triton kernels
under ``-m gpu``), and on the GPU the memory is really given back.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch import nn

from fp8shard.fp8 import Float8Tensor
from fp8shard.optim import DistributedFusedAdam, flat
from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.collectives import Handle
from fp8shard.optim.flat import GradSync
from fp8shard.optim.layout import ParamSpec, build_layout
from tests.optim.test_fused_step_optimizer import _backward, _opt_params


class _NoComm:
    """Stands in for collectives.Group at one rank: a reduce-scatter that leaves the bucket as is."""

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, kind: str) -> Handle:
        return Handle(None)


def _indices(layouts) -> list[list[int]]:
    return [[p.index for p in lay.params] for lay in layouts]


def test_regions_are_cut_between_parameters_at_the_cap():
    specs = [ParamSpec(i, n, "k") for i, n in enumerate([10, 20, 5, 40, 3])] + [ParamSpec(5, 7, "j")]
    capped = build_layout(specs, world_size=2, bucket_numel=16, alignment=4, region_numel=32)
    # 10 + gap 2 + 20 = 32 fits; 5 would end at 37; 40 alone (larger than the cap); then 3.
    assert _indices(capped) == [[0, 1], [2], [3], [4], [5]]
    assert [lay.key for lay in capped] == ["k", "k", "k", "k", "j"]
    for lay in capped:  # each region a layout of its own: starts at 0, buckets cover it whole
        assert lay.params[0].start == 0 and lay.buckets[0].start == 0
        assert lay.numel % (2 * 4) == 0 and lay.numel >= lay.params[-1].end
    assert _indices(build_layout(specs, 2, 16, 4)) == [[0, 1, 2, 3, 4], [5]]  # no cap: one per key
    with pytest.raises(ValueError, match="region_numel"):
        build_layout(specs, 2, 16, 4, region_numel=0)


def test_the_backward_allocates_each_region_when_it_reaches_it_and_the_reset_frees_them(monkeypatch):
    sizes = [5, 9, 3, 12, 7]
    params = {i: nn.Parameter(torch.zeros(n)) for i, n in enumerate(sizes)}
    specs = [ParamSpec(i, sizes[i], torch.float32) for i in reversed(range(len(sizes)))]
    layouts = build_layout(specs, world_size=2, bucket_numel=8, alignment=4, region_numel=16)
    regions = [RegionBuffers(lay, 0, torch.device("cpu"), torch.float32, torch.float32) for lay in layouts]
    assert len(regions) == 4 and any(rb.grad_gaps is not None for rb in regions)
    region_of = {p.index: ri for ri, lay in enumerate(layouts) for p in lay.params}
    sync = GradSync(regions, params, _NoComm(), overlap=True)  # type: ignore[arg-type]
    assert all(rb.grad_buffer is None for rb in regions)  # nothing between steps
    real_empty = torch.empty

    def poisoned(*shape, **kw):  # what a reused block may hold: the padding must be zeroed
        return real_empty(*shape, **kw).fill_(float("nan"))

    monkeypatch.setattr(flat.torch, "empty", poisoned)
    gen = torch.Generator().manual_seed(0)
    grads = {i: torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
    arrived: set[int] = set()
    for i in (4, 3, 1, 0):  # backward order; parameter 2 gets no gradient
        params[i].grad = grads[i].clone()
        sync.accumulate(i, params[i])
        arrived.add(i)
        live = {ri for ri, rb in enumerate(regions) if rb.grad_buffer is not None}
        assert live == {region_of[j] for j in arrived}  # only the regions reached so far
    sync.finish()  # launches parameter 2's bucket: its region allocated, its slot zeroed
    monkeypatch.undo()
    for ri, rb in enumerate(regions):
        want = torch.zeros(rb.layout.numel)
        for p in rb.layout.params:
            if p.index in arrived:
                want[p.start:p.end] = grads[p.index]
        assert torch.equal(rb.grad_buffer, want), ri  # padding 0 (not NaN), parameter 2's slot 0
    refs = [weakref.ref(rb.grad_buffer) for rb in regions]
    sync.reset()
    assert all(rb.grad_buffer is None for rb in regions)
    assert all(r() is None for r in refs)  # no view of them left anywhere: the storage is freed


def _state(params, opt: DistributedFusedAdam) -> list[torch.Tensor]:
    out = [p._data.view(torch.uint8) if isinstance(p, Float8Tensor) else p.detach() for p in params]
    out += [p._scale_inv for p in params if isinstance(p, Float8Tensor)]
    sd = opt.state_dict()
    for i in sorted(sd["state"]):
        out += [sd["state"][i][k] for k in ("master", "exp_avg", "exp_avg_sq")]
    return [t.clone().cpu() for t in out]


def _train(device: str, region_cap_mb: float, scaling: str, step_kernel: str) -> list[list[torch.Tensor]]:
    params = _opt_params(0, device)
    groups = [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0, "lr": 3e-3}]
    opt = DistributedFusedAdam(groups, lr=1e-2, weight_decay=0.1, bucket_cap_mb=20000 * 2 / 2**20,
                               region_cap_mb=region_cap_mb, fp8_weight_scaling=scaling,
                               step_kernel=step_kernel)  # type: ignore[arg-type]
    states = [[torch.tensor(len(opt.engine.regions))]]
    for step in range(1, 7):
        if step == 2:  # two micro-batches: the first only accumulates
            with opt.no_sync():
                _backward(params, 20, device)
        if step != 5:  # step 5: no gradient at all
            _backward(params, step, device, nan=step == 3)
        opt.step()  # (no clipping: the norm's fp32 sum runs over the shards, in their order)
        assert opt.last_step_skipped == (step in (3, 5))
        assert all(rb.grad_buffer is None for rb in opt.engine.regions)  # released with the step
        states.append(_state(params, opt))
        opt.zero_grad()
    return states


def _same_training(device: str, scaling: str, step_kernel: str) -> None:
    one = _train(device, math.inf, scaling, step_kernel)
    many = _train(device, 1000 * 2 / 2**20, scaling, step_kernel)  # 1000 bf16 gradients a region
    assert int(one[0][0]) == 4  # one per storage dtype: E4M3, E5M2, bf16, fp32
    assert int(many[0][0]) == 6  # the three E4M3 weights in regions of their own
    for step, (a, b) in enumerate(zip(one[1:], many[1:], strict=True), 1):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"step {step}"


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("step_kernel", ["reference", "fused"])
def test_many_regions_train_as_one(scaling, step_kernel):
    """Six steps (two micro-batches in one, a NaN gradient, a step without gradients): with one
    region per storage dtype and with every weight in a region of its own, every weight byte,
    scale, master and moment is the same after every step, and no gradient outlives a step."""
    _same_training("cpu", scaling, step_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_many_regions_train_as_one_on_the_gpu(scaling):
    """The same with the Triton kernels (one launch per region): bit for bit."""
    _same_training("cuda", scaling, "auto")


def _nothing_holds_the_gradients(device: str, step_kernel: str) -> None:
    """Steps as the training loop takes them (``step()``, ``zero_grad()``, the skip decision not
    read in between): after each, no tensor of the step's gradient buffers is alive anywhere
    (the fused kernel's pending decision included), and on CUDA the allocated memory says so."""
    params = _opt_params(0, device)
    opt = DistributedFusedAdam(params, lr=1e-2, region_cap_mb=1000 * 2 / 2**20,
                               step_kernel=step_kernel)  # type: ignore[arg-type]
    grad_bytes = sum(rb.layout.numel * 2 for rb in opt.engine.regions)  # bf16
    cuda = device == "cuda"
    for step in range(1, 4):
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        _backward(params, step, device)
        refs = [weakref.ref(rb.grad_buffer) for rb in opt.engine.regions]
        if cuda:
            during = torch.cuda.memory_allocated()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        assert all(r() is None for r in refs), step
        if cuda:
            torch.cuda.synchronize()
            after = torch.cuda.memory_allocated()
            assert during - before >= grad_bytes  # the gradients exist through the backward
            assert during - after >= grad_bytes  # and are given back with the step
    assert not opt.last_step_skipped


@pytest.mark.parametrize("step_kernel", ["reference", "fused"])
def test_nothing_holds_the_gradients_after_the_step(step_kernel):
    _nothing_holds_the_gradients("cpu", step_kernel)


@pytest.mark.gpu
def test_the_gradient_memory_is_given_back_after_the_step():
    """On the GPU (Triton kernels, the decision on the device) the caching allocator gets the
    gradient blocks back with ``step()``."""
    _nothing_holds_the_gradients("cuda", "auto")

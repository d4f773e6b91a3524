"""The optimizer step's host path: what ``step()`` does per parameter outside its kernels.

The step hands each FP8 weight its new scale once its buckets arrive (``ParamSync`` ->
``WeightQuantizers.set_scale_inv``) and checks first that every parameter still lives in the
optimizer's buffer (``FlatEngine.begin_step``). Each does its per-parameter work once, at
construction or on first use, and a few batched ops per step; these tests hold them to what the
per-parameter versions did.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8shard.fp8 import Float8Tensor
from fp8shard.optim import DistributedFusedAdam
from tests.optim.dist_cases import TinyMixed
from tests.optim.test_fused_step_optimizer import _backward, _opt_params


def _general_wait(sync) -> list[int]:
    """What ``ParamSync.wait`` hands on when it goes through the buckets one by one."""
    got: list[list[int]] = []
    sync.on_params_ready, real = got.append, sync.on_params_ready
    try:
        sync.launch_all()
        sync.wait(list(sync.pending))
    finally:
        sync.on_params_ready = real
    return got[0]


@pytest.mark.parametrize("bucket_elems", [40, 100000])
def test_waiting_for_every_gather_at_once_readies_what_waiting_one_by_one_does(bucket_elems):
    """Buckets small enough that weights straddle them, and one bucket for all: ``wait_all``'s
    precomputed list is the one-by-one wait's, each parameter exactly once; after a module's
    pre-hook waited for some buckets, ``wait_all`` readies the rest and nothing twice."""
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=bucket_elems * 2 / 2**20)
    sync = opt.engine.param_sync
    n_buckets = sum(len(rb.layout.buckets) for rb in opt.engine.regions)
    assert (n_buckets > len(opt.engine.regions)) == (bucket_elems < 1000)  # else one per region
    expected = _general_wait(sync)
    assert sorted(expected) == list(range(len(opt._params)))
    got: list[list[int]] = []
    sync.on_params_ready = got.append
    sync.launch_all()
    sync.wait_all()
    assert got == [expected] and not sync.pending
    got.clear()
    sync.launch_all()
    first = sync.where[0][1]  # fc1.weight's buckets, as its module's pre-hook would wait
    sync.wait(first)
    sync.wait_all()
    flat = [i for call in got for i in call]
    assert sorted(flat) == list(range(len(opt._params))) and 0 in got[0]


def test_new_scales_land_on_the_weights_and_a_skipped_step_keeps_theirs():
    """``set_scale_inv`` for all weights and for a subset (as overlapping gathers land), with the
    step applied and skipped on the device: each weight gets its slot's value or keeps its own,
    bit for bit; a weight whose scale tensor was replaced since still gets its value."""
    params = _opt_params(0, "cpu")
    opt = DistributedFusedAdam(params, lr=1e-2)
    fp8 = opt.engine.fp8
    weights = {i: p for i, p in enumerate(params) if isinstance(p, Float8Tensor)}
    new = torch.rand(fp8.num_slots) + 0.5
    before = {i: p._scale_inv.clone() for i, p in weights.items()}
    fp8.set_scale_inv(weights, new, torch.tensor(False))
    assert all(torch.equal(p._scale_inv, before[i]) for i, p in weights.items())
    fp8.set_scale_inv(weights, new, torch.tensor(True))
    assert all(torch.equal(p._scale_inv, new[fp8.slot[i]]) for i, p in weights.items())
    some = {i: weights[i] for i in list(weights)[1:3]}
    newer = new * 3
    weights[list(weights)[1]]._scale_inv = torch.tensor(7.0)  # a new tensor object, as a load might
    fp8.set_scale_inv(some, newer)
    for i, p in weights.items():
        want = newer[fp8.slot[i]] if i in some else new[fp8.slot[i]]
        assert torch.equal(p._scale_inv, want), i
    assert len(fp8._ready) == 2  # one staging entry per set of weights, reused after


def test_the_optimizer_refuses_an_fp8_weight_whose_bytes_moved_out_of_its_buffer():
    """``begin_step`` reads one pointer per parameter: an FP8 weight whose ``_data`` was replaced
    is caught as a plain parameter's ``.data`` is (test_single_process.py)."""
    params = _opt_params(0, "cpu")
    opt = DistributedFusedAdam(params, lr=1e-2)
    _backward(params, 1, "cpu")
    opt.step()
    params[1]._data = params[1]._data.clone()
    _backward(params, 2, "cpu")
    with pytest.raises(RuntimeError, match="parameter 1 no longer lives in the optimizer's buffer"):
        opt.step()


def test_a_parameter_written_in_place_still_lives_in_the_buffer():
    """In-place writes (``copy_``, the checkpoint loaders' way) keep the pointer: no error."""
    p = nn.Parameter(torch.randn(10))
    opt = DistributedFusedAdam([p], lr=1e-2)
    with torch.no_grad():
        p.copy_(torch.ones(10))
    (p * 2).sum().backward()
    opt.step()
    assert not opt.last_step_skipped


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_tiled_weights_of_any_shape_share_one_scales_call(recipe):
    """Weights of three shapes with row or block scales: one quantizer group (one ``scales`` call
    a step over every tile, a contiguous run of slots); each weight's step is still its own
    recipe's quantization of its master (tests/optim/test_tiled_weights.py)."""
    from fp8shard.fp8.tiled import tile_scales
    from tests.optim import tiled_cases as tc

    model = tc.build(recipe)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2)
    fp8 = opt.engine.fp8
    (group,) = fp8.groups
    assert group.run == slice(0, fp8.num_slots) and fp8.num_slots > 3
    amax = torch.rand(fp8.num_slots) * 10
    amax[0], amax[-1] = 0.0, float("nan")  # the guards: scale 1 for both
    scales = fp8.cast_scales(amax)
    assert torch.equal(scales, tile_scales(amax, group.fmt))
    assert scales[0] == 1 and scales[-1] == 1

"""Rowwise and blockwise FP8 weights in DistributedFusedAdam ([Note: tiled weight casts]):
shards on row / 128-row band boundaries, the cast through the recipe's quantizer, and parity
with a quantized reference master for every recipe, at 1 and 2 ranks."""

from __future__ import annotations

import random

import pytest
import torch

import fp8shard as fs
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim.layout import ParamSpec, build_layout
from fp8shard.optim.step_kernel import FlatReferenceKernel
from tests.optim import tiled_cases as tc

RECIPES = ["delayed", "current", "rowwise", "blockwise"]


def test_shard_boundaries_fall_on_unit_boundaries():
    rng = random.Random(0)
    for _ in range(200):
        specs = []
        for i in range(rng.randint(1, 6)):
            rows, cols = rng.randint(1, 300), rng.randint(1, 40)
            unit = rng.choice([1, cols, min(128, rows) * cols])
            specs.append(ParamSpec(i, rows * cols, "fp8", unit))
        world = rng.randint(1, 5)
        for region in build_layout(specs, world, rng.randint(1, 4000), rng.choice([1, 16])):
            unit = region.unit
            for p in region.params:
                for b in region.buckets:  # no shard boundary strictly inside one of p's units
                    for r in range(world + 1):
                        cut = b.start + r * b.shard_numel
                        inside = p.start < cut < p.end
                        assert not inside or (cut - p.start) % unit == 0, (p, b, unit)
            for rank in range(world):
                for pc in region.pieces(rank):
                    assert pc.param_offset % unit == 0


def test_each_weight_unit_gets_its_region():
    specs = [ParamSpec(0, 6000, "fp8", 200), ParamSpec(1, 60, "fp8"), ParamSpec(2, 4000, "fp8", 200)]
    regions = build_layout(specs, world_size=3, bucket_numel=10_000, alignment=16)
    assert [(r.key, r.unit, [p.index for p in r.params]) for r in regions] == [
        ("fp8", 200, [0, 2]), ("fp8", 1, [1])]
    tiled = regions[0]
    assert all(p.start % 400 == 0 for p in tiled.params)  # lcm(16, 200)
    assert all(b.shard_numel % 400 == 0 for b in tiled.buckets)


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_step_equals_quantizing_the_reference_master(recipe):
    res = tc.one_step_against_reference(recipe, bucket_cap_mb=0.05)
    assert res["equal"] and all(res["equal"].values()), res["equal"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_equal_quantizing_the_reference_master(recipe, dist_pools):
    for res in dist_pools(2).run(tc.one_step_against_reference, recipe, 0.05):
        assert all(res["equal"].values()), res["equal"]
        if recipe in ("rowwise", "blockwise"):
            assert res["kernel"] == "FlatReferenceKernel"  # [Note: tiled weight casts]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_neighbouring_tiled_weights_are_cast_as_one_view(recipe, ranks, dist_pools):
    """Weights of one row length side by side in a region are one 2-D view for their quantizer's
    stats and cast where each ends on a tile-row boundary ([Note: tiled weight casts]): fewer
    calls, the same bytes and scales as each weight's own quantization."""
    run = (lambda f, *a: [f(*a)]) if ranks == 1 else dist_pools(2).run
    results = run(tc.one_step_against_reference, recipe, 1.0, tc.SIDE_BY_SIDE)
    for res in results:
        assert all(res["equal"].values()), res["equal"]
    if ranks == 1:  # in the layout's order (the backward's): 130, 64, 128, 200, 384, 256
        # rowwise: every row its own tile, all six one view; blockwise: the 64-row weight has its
        # own region (its unit is 64 rows), and the 130- and 200-row weights' last bands are
        # partial, so each closes its view: 130 | 128 200 | 384 256 || 64
        assert results[0]["pieces"] == ((6, 1) if recipe == "rowwise" else (6, 4))
    else:  # each rank's share of the pieces, joined where it holds neighbours
        assert all(joined <= raw for raw, joined in (r["pieces"] for r in results))
        assert any(joined < raw for raw, joined in (r["pieces"] for r in results)), results


def test_a_piece_joins_its_neighbour_only_after_whole_bands():
    """The guard behind the joins: a blockwise piece whose last band is partial (130 rows) closes
    its view even where the next piece follows it directly; per-tensor pieces never join."""
    from fp8shard.fp8 import Fp8Format
    from fp8shard.fp8.tiled import weight_quantizer
    from fp8shard.optim.fp8_weights import _joins, _Piece

    q, fmt = weight_quantizer((128, 128)), Fp8Format.E4M3

    def piece(start: int, rows: int, band: int = 128) -> _Piece:
        n = rows * 96
        return _Piece(q, fmt, slice(start, start + n), slice(start, start + n), 96, (), slice(0),
                      (-(-rows // max(band, 1)), 1), band)

    assert _joins(piece(0, 256), piece(256 * 96, 130))
    assert not _joins(piece(0, 130), piece(130 * 96, 128))  # a partial band: its own view
    assert not _joins(piece(0, 256), piece(257 * 96, 128))  # not adjacent
    assert not _joins(piece(0, 1, band=0), piece(96, 1, band=0))  # per tensor: one slot each


def test_tiled_weights_refuse_the_fused_step_and_delayed_weight_scaling():
    model = tc.build("blockwise")
    with pytest.raises(ValueError, match=r"step_kernel='fused' casts per-tensor FP8 weights only.*"
                                         r"use step_kernel='reference' or 'auto'"):
        DistributedFusedAdam(model.parameters(), step_kernel="fused")
    model = tc.build("rowwise")
    with pytest.raises(ValueError, match=r"fp8_weight_scaling='delayed' is per-tensor only.*'current'"):
        DistributedFusedAdam(model.parameters(), fp8_weight_scaling="delayed")
    assert isinstance(DistributedFusedAdam(model.parameters()).engine.kernel, FlatReferenceKernel)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_scales_are_set_with_the_gathered_bytes_and_saved_as_grids(recipe):
    model = tc.build(recipe)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=0.05)
    with fs.fp8_autocast(recipe=recipe):
        model(torch.randn(4, tc.SHAPES[0][1])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        if isinstance(p, fs.Float8Tensor):
            scale = sd["state"][i]["fp8"]["scale"]
            assert scale.shape == p.scale_inv.shape and torch.equal(scale.reciprocal(), p.scale_inv)


# Per-tensor weights are one implementation of the quantizer protocol, not a branch of the
# optimizer ([Note: weight scaling]): a quantizer substituted where WeightQuantizers chooses one
# sees every recipe's stats, scales and casts, and the results stay bit for bit.
class _Recording:
    """A weight quantizer that records the protocol calls it gets, then does what ``inner`` does."""

    def __init__(self, inner, calls: list) -> None:
        self.inner, self.calls = inner, calls

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("local_stats", "scales", "cast_scaled", "state", "load_state"):
            return attr

        def call(*args, **kwargs):
            self.calls.append((self.inner.name, name))
            return attr(*args, **kwargs)
        return call


def _record_quantizers(monkeypatch) -> list:
    from fp8shard.fp8 import quantizer

    calls: list = []
    choose = quantizer._choose_quantizer
    monkeypatch.setattr(quantizer, "_choose_quantizer", lambda *a, **k: _Recording(choose(*a, **k), calls))
    return calls


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_goes_through_its_weight_quantizer(recipe, monkeypatch):
    calls = _record_quantizers(monkeypatch)
    res = tc.one_step_against_reference(recipe, bucket_cap_mb=0.05)
    assert res["equal"] and all(res["equal"].values()), res["equal"]
    assert res["kernel"] == "FlatReferenceKernel"
    name = {"current": "tensorwise"}.get(recipe, recipe)
    assert {(name, m) for m in ("local_stats", "scales", "cast_scaled")} <= set(calls), calls
    assert {n for n, _ in calls} == {name}


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_the_fused_step_takes_its_scales_from_the_quantizer(scaling, monkeypatch):
    """The fused step casts in its kernels (same per-slot scales); the scales are the quantizer's."""
    calls = _record_quantizers(monkeypatch)
    model = tc.build(scaling)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=0.05, step_kernel="fused",
                               fp8_weight_scaling=scaling)
    model(torch.randn(4, tc.SHAPES[0][1])).sum().backward()
    opt.step()
    name = {"current": "tensorwise", "delayed": "delayed"}[scaling]
    assert (name, "scales") in calls
    sd = opt.state_dict()["state"][0]["fp8"]
    assert set(sd) == ({"scale"} if scaling == "current" else {"scale", "amax_history"})
    assert (name, "state") in calls

"""Formats, the scale rule and the recipes ([Note: scale], [Note: formats])."""

from __future__ import annotations

import math

import pytest
import torch

import fp8shard as fs
from fp8shard.fp8 import AmaxHistory, scale_from_amax


def test_formats():
    assert fs.Fp8Format.E4M3.max == 448.0 and fs.Fp8Format.E4M3.torch_dtype == torch.float8_e4m3fn
    assert fs.Fp8Format.E5M2.max == 57344.0 and fs.Fp8Format.E5M2.torch_dtype == torch.float8_e5m2
    assert fs.Fp8Format.parse("e5m2") is fs.Fp8Format.E5M2
    assert fs.Fp8Format.parse(torch.float8_e4m3fn) is fs.Fp8Format.E4M3


def test_scale_guards_keep_previous_scale():
    prev = torch.tensor([2.0, 3.0, 4.0, 5.0, 6.0])
    amax = torch.tensor([0.0, math.inf, math.nan, 1e-45, 4.0])
    s = scale_from_amax(amax, 448.0, prev)
    assert torch.equal(s[:4], prev[:4])  # zero, inf, NaN amax and an overflowing scale
    assert s[4].item() == 112.0
    assert torch.equal(scale_from_amax(torch.tensor(0.0), 448.0), torch.tensor(1.0))


def test_margin():
    assert scale_from_amax(torch.tensor(7.0), 448.0, margin=2).item() == pytest.approx(448 / 7 / 4)


def test_recipe_formats():
    assert fs.DelayedScaling().fp8_format is fs.RecipeFormat.HYBRID
    assert fs.DelayedScaling().fp8_format.bwd is fs.Fp8Format.E5M2
    assert fs.CurrentScaling(fp8_format="e4m3").fp8_format.bwd is fs.Fp8Format.E4M3
    r = fs.DelayedScaling(margin=1, amax_history_len=16, amax_compute_algo="most_recent")
    assert (r.margin, r.amax_history_len, r.amax_compute_algo) == (1, 16, "most_recent")


@pytest.mark.parametrize("kwargs,match", [
    ({"margin": -1}, "margin"),
    ({"amax_history_len": 0}, "amax_history_len"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ({"fp8_format": "e3m4"}, "fp8_format"),
])
def test_bad_recipes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fs.DelayedScaling(**kwargs)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_amax_history_rolls_and_updates_scales(algo):
    h = AmaxHistory(2, fs.DelayedScaling(amax_history_len=3, amax_compute_algo=algo, margin=1), 448.0)
    steps = [(4.0, 1.0), (2.0, 0.0), (1.0, 8.0), (0.5, 0.5)]
    window: list[list[float]] = []
    scale = [1.0, 1.0]
    for a0, a1 in steps:
        h.record(0, torch.tensor(a0))
        h.record(1, torch.tensor(a1))
        window = ([[a0, a1], *window])[:3]
        got = h.update()
        for slot in range(2):
            vals = [w[slot] for w in window]
            a = max(vals) if algo == "max" else vals[0]
            if a > 0:
                scale[slot] = 448.0 / a / 2
            assert got[slot].item() == pytest.approx(scale[slot])
        assert torch.all(h.history[0] == 0)  # slot 0 is free for the next iteration
    sd = h.state_dict()
    h2 = AmaxHistory(2, h.recipe, 448.0)
    h2.load_state_dict(sd)
    assert torch.equal(h2.history, h.history) and torch.equal(h2.scale, h.scale)

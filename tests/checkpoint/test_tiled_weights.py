"""Rowwise and blockwise FP8 weights through checkpoints: bytes and scale grids round trip bit
for bit, load at another world size (saved at 2 ranks, loaded at 1 and 4), and a resumed run
is the uninterrupted one ([Note: checkpoint keys], [Note: tiled weight casts])."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8shard.checkpoint import read_manifest
from tests.checkpoint import tiled_cases as tc

SAVE_AT, STEPS = 3, 5


@pytest.fixture(scope="module", params=["rowwise", "blockwise"])
def saved(request, dist_pools, tmp_path_factory):
    recipe = request.param
    path = str(tmp_path_factory.mktemp(recipe) / "ck")
    out = dist_pools(2).run(tc.run_save, path, recipe, SAVE_AT)
    return recipe, path, out


def test_manifest_names_each_weight_tile(saved):
    recipe, path, _ = saved
    blocks = {n: e.get("fp8_block") for n, e in read_manifest(Path(path))["model"].items() if e["fp8"]}
    assert blocks and all(b is not None for b in blocks.values())
    if recipe == "blockwise":
        assert set(map(tuple, blocks.values())) == {(128, 128)}
    else:
        assert all(b[0] == 1 for b in blocks.values())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_load_at_any_world_size_is_bit_exact(saved, dist_pools, world_size):
    recipe, path, out = saved
    loaded = dist_pools(world_size).run(tc.run_load, path, recipe)
    for r in loaded:
        assert r["loaded"]["model"] == out[0]["model"]  # FP8 bytes and scale grids
        assert r["loaded"]["optim"] == out[0]["optim"]  # masters, moments, weight scales


def test_resume_is_the_uninterrupted_run(saved, dist_pools):
    recipe, path, _ = saved
    straight = dist_pools(2).run(tc.run_straight, recipe, STEPS)[0]
    resumed = dist_pools(2).run(tc.run_load, path, recipe, SAVE_AT, STEPS)[0]
    assert resumed["losses"] == straight["losses"][SAVE_AT:]
    assert resumed["model"] == straight["model"] and resumed["optim"] == straight["optim"]

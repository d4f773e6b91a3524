"""Rowwise and blockwise FP8 weights through checkpoints: bytes and scale grids round trip bit
for bit, load at another world size (saved at 2 ranks, loaded at 1 and 4), and a resumed run
is the uninterrupted one ([Note: checkpoint keys], [Note: tiled weight casts])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8shard.checkpoint import read_manifest
from fp8shard.fp8 import Float8Tensor
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


def test_scale_grids_are_format_version_2_which_a_version_1_reader_refuses(saved, monkeypatch):
    """A reader of version 1 would take a weight's scale grid for one scale: it must refuse the
    checkpoint (naming the upgrade), not misread it."""
    from fp8shard.checkpoint import manifest
    from fp8shard.checkpoint.errors import CheckpointFormatError

    _, path, _ = saved
    assert read_manifest(Path(path))["version"] == 2
    monkeypatch.setattr(manifest, "VERSION", 1)
    with pytest.raises(CheckpointFormatError, match=r"format version 2 .*reads versions up to 1: upgrade"):
        read_manifest(Path(path))


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


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_export_round_trip_is_bit_exact(recipe, tmp_path):
    """Exported FP32 masters imported into a fresh model give the trained bytes and scale grids
    (the optimizer's cast is the recipe's quantization of the master); exported weights are the
    trained weights' values."""
    safetensors = pytest.importorskip("safetensors.torch")
    from fp8shard.checkpoint import export_safetensors, import_hf_state_dict, save_checkpoint

    model, opt = tc.build(recipe)
    tc.train(model, opt, recipe, 0, 2)
    path = save_checkpoint(tmp_path / "ck", model, opt, step=2)
    weights = safetensors.load_file(str(export_safetensors(path, None, tmp_path / "w.safetensors",
                                                           dtype=torch.float32)))
    masters = safetensors.load_file(str(export_safetensors(path, None, tmp_path / "m.safetensors",
                                                           source="master", dtype=torch.float32)))
    fresh, _ = tc.build(recipe, seed=5)
    import_hf_state_dict(fresh, masters)
    mine = dict(fresh.named_parameters())
    tiled = 0
    for n, p in model.named_parameters():
        if isinstance(p, Float8Tensor):
            tiled += 1
            assert torch.equal(weights[n], p.dequantize().float()), n  # in its nominal dtype
            q = mine[n]
            assert q.block == p.block and torch.equal(q.uint8_view(), p.uint8_view()), n
            assert torch.equal(q.scale_inv, p.scale_inv), n
    assert tiled == 8

"""Rowwise and blockwise FP8 weights on the FSDP2 engine ([Note: FSDP2 tiled weights]): the
flat engine's losses, the bytes and scale rows on the wire, and checkpoints either engine
resumes. Multi-process gloo tests; the cases are in cases.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import pools_fixture
from tests.fsdp2 import cases

dist_pools = pools_fixture("gloo")

RECIPES = ["rowwise", "blockwise"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_losses_match_flat_engine_2_ranks(dist_pools, recipe):
    """The same model, data and optimizer math: on 2 ranks FSDP2's 12 losses are the flat
    engine's bit for bit (the same bf16 gradient average, the same Adam, the same per-row or
    per-block scales of the same master tiles -- local to a rank on FSDP2, MAX-merged with zeros
    on the flat engine)."""
    pool = dist_pools(2)
    flat = pool.run(cases.run_losses, "flat", 12, recipe=recipe)[0]
    fsdp2 = pool.run(cases.run_losses, "fsdp2", 12, recipe=recipe)[0]
    assert fsdp2[-1] < fsdp2[0] - 1.0  # it trains
    assert fsdp2 == flat


@pytest.mark.parametrize("recipe", RECIPES)
def test_losses_match_flat_engine_1_rank(dist_pools, recipe):
    """At a shard world size of 1 FSDP2 gathers nothing and copies only the first all-gather
    input: the bytes and the grid travel packed as one ([Note: FSDP2 tiled weights]). Found on
    the GPU (one H100, where they failed to unpack); the same losses as the flat engine."""
    pool = dist_pools(1)
    flat = pool.run(cases.run_losses, "flat", 12, recipe=recipe)[0]
    fsdp2 = pool.run(cases.run_losses, "fsdp2", 12, recipe=recipe)[0]
    assert fsdp2[-1] < fsdp2[0] - 1.0
    assert fsdp2 == flat


def test_hsdp_2x2_rowwise_matches_flat_engine(dist_pools):
    """HSDP (2 replicas x 2 shards): each shard's rows and grid rows gather over the shard
    dimension only; with fp32 gradients the losses are the flat engine's on 4 ranks to fp32
    rounding (the gradient average sums in two stages), within 0.2% once a last-bit difference
    flips an FP8 byte."""
    pool = dist_pools(4)
    flat = pool.run(cases.run_losses, "flat", 6, params_dtype="fp32", recipe="rowwise")[0]
    hsdp = pool.run(cases.run_losses, "fsdp2", 6, replicate=2, params_dtype="fp32", recipe="rowwise")[0]
    assert hsdp[:3] == pytest.approx(flat[:3], rel=1e-6)
    assert hsdp == pytest.approx(flat, rel=2e-3)
    assert hsdp[-1] < hsdp[0] - 0.5


@pytest.mark.parametrize(("out_features", "recipe", "message"), [
    (255, "blockwise", "an FP8 shard on some ranks and a plain one on others"),  # 128 + 127 rows
    (200, "blockwise", "gives each rank 100 rows, not a multiple of 128"),
    (7, "rowwise", "cuts its 7 rows unevenly"),
    (256, "blockwise", ""),  # whole bands: taken
])
def test_fsdp2adam_refuses_tiled_weights_fully_shard_cut_through_their_tiles(dist_pools, out_features,
                                                                             recipe, message):
    """torch's fully_shard used directly is not checked before it cuts; FSDP2Adam refuses what
    it left, on every rank alike (one rank alone raising would leave the others in a collective)."""
    errors = dist_pools(2).run(cases.direct_fully_shard_refused, out_features, recipe)
    assert all(message in e for e in errors) and len(set(errors)) == 1
    if message:  # each names the fix
        assert "fully_shard_model" in errors[0] or "trainer.strategy=flat" in errors[0]
    else:
        assert errors == ["", ""]


# Per FP8 weight element and gather: the bytes, plus 4 bytes per row (rowwise; rows 128 + 64 +
# 64 of 20480 weights) or per 128x128 block (blockwise; 8 + 8 + 4 blocks of 327680 weights).
WIRE = {("rowwise", 2): (20480 + 4 * 256) / 20480, ("rowwise", 4): (20480 + 4 * 256) / 20480,
        ("blockwise", 2): (327680 + 4 * 20) / 327680}


@pytest.mark.parametrize(("recipe", "world"), list(WIRE))
def test_all_gather_moves_the_bytes_and_the_scale_rows(dist_pools, recipe, world):
    """Counted on the wire: one uint8 all-gather per module carries the FP8 bytes and the grid
    rows (1.05 B/weight rowwise, 1.00024 blockwise at these small shapes), exactly what the
    hooks hand FSDP2; the local shards are FP8 with their rows of the grid, FSDP2's flat view
    of them too; the optimizer runs no amax all-reduce (the tiles are whole on each rank)."""
    r = dist_pools(world).run(cases.wire_bytes, recipe=recipe)[0]
    assert r["keys"] == ["all_gather.params.uint8", "reduce_scatter.grads.float32"]
    assert r["bytes_per_elem_per_step"] == WIRE[recipe, world]
    assert r["expected_per_elem"] == WIRE[recipe, world]
    assert r["report"]["all_gather.params.uint8"] == WIRE[recipe, world] * r["n"]
    assert "all_reduce.amax" not in r["report"]
    dims = cases.STACK_DIMS[recipe]
    if recipe == "rowwise":
        assert r["blocks"] == [(1, i) for i, _ in dims]
        assert r["grids"] == [(o // world, 1) for _, o in dims]
    else:
        assert r["blocks"] == [(128, 128)] * 3
        assert r["grids"] == [(o // world // 128, i // 128) for i, o in dims]
    assert r["flat_views_fp8"]


def test_1_3b_like_shapes_gather_at_most_1_01_bytes_per_weight():
    """The 1.3B-like shapes (hidden 2048, ffn 8192: qkv, proj, fc1, fc2) at 8 shard ranks, as the
    hooks hand them to FSDP2: rowwise 1.0015 and blockwise 1.0002 B per weight (4 bytes per
    2048- or 8192-long row; per 16384-weight block)."""
    import fp8shard as fs
    from fp8shard.fp8 import Float8Tensor

    world, shapes = 8, [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]
    got = {}
    for recipe in RECIPES:
        n = total = 0
        for rows, cols in shapes:
            local = Float8Tensor.quantize(torch.randn(rows // world, cols), fs.Fp8Format.E4M3, recipe=recipe)
            total += cases.gather_input_bytes(local, torch.Size([rows, cols]), world)
            n += rows * cols
        got[recipe] = total / n
    rows_all = sum(r for r, _ in shapes)
    assert got["rowwise"] == (sum(r * c for r, c in shapes) + 4 * rows_all) / sum(r * c for r, c in shapes)
    assert got["blockwise"] == 1 + 4 / (128 * 128)
    assert round(got["rowwise"], 4) == 1.0015 and round(got["blockwise"], 4) == 1.0002
    assert max(got.values()) <= 1.01


@pytest.mark.parametrize(("recipe", "src", "src_world", "dst", "dst_world"), [
    ("rowwise", "flat", 2, "fsdp2", 4),
    ("rowwise", "fsdp2", 4, "flat", 2),
    ("blockwise", "flat", 4, "fsdp2", 2),
    ("blockwise", "fsdp2", 2, "flat", 4),
])
def test_cross_resume(dist_pools, tmp_path, recipe, src, src_world, dst, dst_world):
    """After the load every parameter's master, moments, FP8 bytes, scale grid (the model's and
    the optimizer's) hash as saved, and training goes on with the losses of the run that never
    stopped (to the rounding of a bf16 gradient average over another number of ranks)."""
    path = str(tmp_path / "step_00000003")
    saved, cont = dist_pools(src_world).run(cases.save_after, src, path, 3, 3, recipe)[0]
    loaded, resumed, written_by = dist_pools(dst_world).run(cases.load_and_continue, dst, path, 3, recipe)[0]
    assert written_by == src_world
    assert sum(k.endswith("/scale_inv_grid") for k in saved) == 8  # 4 projections x 2 layers
    assert loaded == saved  # bit-exact model-space state
    assert resumed == pytest.approx(cont, rel=5e-3)

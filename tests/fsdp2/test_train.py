"""``python -m fp8shard.train trainer.strategy=fsdp2``: the same run as the flat engine's, and
checkpoints that either engine resumes (at another world size, and with HSDP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.helpers import TINY, read_metrics, read_summary, run_train

FAST = [*TINY, "model.hidden_size=32", "data.num_train_tokens=60000", "data.num_val_tokens=8000",
        "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "trainer.val_check_interval=20",
        "model.optim.sched.warmup_steps=3", "trainer.gradient_clip_val=0", "checkpoint.every_n_steps=10",
        "trainer.max_steps=20", "model.fp8_gemm=emulated"]  # one GEMM path: CPU auto times per process


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {"flat": root / "flat", "fsdp2": root / "fsdp2"}
    run_train(out["flat"], FAST, nproc=2)
    run_train(out["fsdp2"], [*FAST, "trainer.strategy=fsdp2"], nproc=2)
    return out


def test_fsdp2_run_is_the_flat_run(runs):
    """2 ranks, no clipping: every logged loss bit for bit; the summary reports the FSDP2
    engine's per-rank shards (a quarter of the flat engine's weights and gradients at 2 ranks:
    1/2 byte per FP8 weight and 1 byte of bf16 gradient, vs 1 and 2)."""
    flat, fsdp2 = _losses(runs["flat"]), _losses(runs["fsdp2"])
    assert sorted(fsdp2) == list(range(1, 21))
    assert fsdp2 == flat
    mem_flat = read_summary(runs["flat"])["memory_bytes_per_rank"]
    mem_fsdp2 = read_summary(runs["fsdp2"])["memory_bytes_per_rank"]
    assert mem_fsdp2["grads"] < mem_flat["grads"]
    assert mem_fsdp2["weights"] < mem_flat["weights"]


def test_fsdp2_resumes_a_flat_checkpoint_with_hsdp_on_4_ranks(runs, tmp_path):
    ck = runs["flat"] / "checkpoints" / "step_00000010"
    run = tmp_path / "hsdp"
    run_train(run, [*FAST, "trainer.strategy=fsdp2", "trainer.hsdp_replicate=2", "model.micro_batch_size=4",
                    f"trainer.resume={ck}"],
              nproc=4, timeout=600)
    mine, ref = _losses(run), _losses(runs["flat"])
    assert sorted(mine) == list(range(11, 21))
    assert [mine[s] for s in mine] == pytest.approx([ref[s] for s in mine], rel=2e-2)


def test_flat_resumes_an_fsdp2_checkpoint(runs, tmp_path):
    """2 -> 2 ranks, FSDP2 -> flat: the losses of the run that never stopped, bit for bit."""
    ck = runs["fsdp2"] / "checkpoints" / "step_00000010"
    run = tmp_path / "flat_from_fsdp2"
    run_train(run, [*FAST, f"trainer.resume={ck}"], nproc=2)
    mine, ref = _losses(run), _losses(runs["fsdp2"])
    assert sorted(mine) == list(range(11, 21))
    assert mine == {s: ref[s] for s in mine}


TILED = {"rowwise": ["model.fp8_recipe=rowwise"],
         # whole 128-row bands per rank: qkv 768, proj 256, fc1 512, fc2 256 rows over 2 ranks
         "blockwise": ["model.fp8_recipe=blockwise", "model.hidden_size=256", "model.ffn_hidden_size=512"]}


@pytest.mark.parametrize("recipe", list(TILED))
def test_fsdp2_trains_rowwise_and_blockwise_fp8_weights_as_the_flat_run(tmp_path, recipe):
    """``trainer.strategy=fsdp2 model.fp8_recipe=rowwise|blockwise model.fp8_params=true``: 2 ranks,
    6 steps, every logged loss the flat run's bit for bit ([Note: FSDP2 tiled weights])."""
    common = [*FAST, "model.fp8=true", "model.fp8_params=true", *TILED[recipe], "trainer.max_steps=6",
              "checkpoint.every_n_steps=0"]
    run_train(tmp_path / "flat", common, nproc=2)
    run_train(tmp_path / "fsdp2", [*common, "trainer.strategy=fsdp2"], nproc=2)
    flat, fsdp2 = _losses(tmp_path / "flat"), _losses(tmp_path / "fsdp2")
    assert sorted(fsdp2) == list(range(1, 7))
    assert fsdp2 == flat
    assert read_summary(tmp_path / "fsdp2")["fp8"]["fp8_recipe"] == recipe

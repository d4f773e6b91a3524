"""``model.fp8_recipe=tensorwise|rowwise|blockwise`` in the training command ([Note: quantizer])."""

from __future__ import annotations

import math

import pytest

import fp8shard as fs
from fp8shard.train.builders import build_recipe
from fp8shard.train.config import ConfigError, load_config
from tests.train.helpers import TINY, read_metrics, read_summary, run_train

STEPS = 4


@pytest.mark.parametrize(("name", "kind"), [("tensorwise", fs.CurrentScaling), ("rowwise", fs.RowwiseScaling),
                                            ("blockwise", fs.BlockwiseScaling)])
def test_recipe_key_builds_the_recipe(name, kind):
    cfg = load_config([f"model.fp8_recipe={name}", "model.fp8_params=false", "model.fp8_hybrid=false"],
                      world_size=1)
    recipe = build_recipe(cfg)
    assert type(recipe) is kind and recipe.fp8_format is fs.RecipeFormat.E4M3


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise"])
def test_training_runs_a_few_steps_with_each_recipe(tmp_path, name):
    run_dir = tmp_path / name
    run_train(run_dir, [*TINY, f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=2",
                        "trainer.val_check_interval=4", f"model.fp8_recipe={name}", "model.fp8_params=false"])
    metrics = read_metrics(run_dir)
    assert [r["step"] for r in metrics] == [2, 4]
    assert all(math.isfinite(r["loss"]) for r in metrics)
    assert metrics[-1]["loss"] < 5.6  # ln(256) = 5.55 at init: it learns, not diverges
    summary = read_summary(run_dir)
    assert summary["fp8"]["fp8_recipe"] == name and summary["fp8"]["fp8"] is True


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.fp8_recipe=rowise"],
     "model.fp8_recipe: 'rowise' is not one of: delayed, current, tensorwise, rowwise, blockwise"),
    (["model.fp8_recipe=blockwise", "trainer.strategy=fsdp2"],
     r"trainer.strategy=fsdp2 with model.fp8_recipe=blockwise model.fp8_params=true: .*each rank 192 rows, "
     r"not a multiple of 128.*trainer.strategy=flat"),
])
def test_bad_recipe_config_names_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides, world_size=2)


TILED_PARAMS = [*TINY, "model.hidden_size=32", "data.num_train_tokens=60000", "data.num_val_tokens=8000",
                "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "trainer.val_check_interval=20",
                "model.fp8=true", "model.fp8_params=true", "model.optim.sched.max_steps=6",
                "checkpoint.every_n_steps=3"]


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_fp8_params_with_a_tiled_recipe_train_and_resume_on_two_ranks(tmp_path, name):
    """model.fp8_params=true with rowwise/blockwise weights ([Note: tiled weight casts]): the loss
    falls, and a run stopped at step 3 and resumed is the uninterrupted run."""
    common = [*TILED_PARAMS, f"model.fp8_recipe={name}"]
    run_train(tmp_path / "straight", [*common, "trainer.max_steps=6"], nproc=2)
    straight = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "straight")]
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for _, v in straight) and straight[-1][1] < straight[0][1]
    stopped = tmp_path / "stopped"
    run_train(stopped, [*common, "trainer.max_steps=3"], nproc=2)
    run_train(stopped, [*common, "trainer.max_steps=6", "trainer.resume=auto"], nproc=2)
    assert read_summary(stopped)["resumed_from"].endswith("step_00000003")
    assert [(r["step"], r["loss"]) for r in read_metrics(stopped)] == straight

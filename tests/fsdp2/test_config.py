"""trainer.strategy / trainer.hsdp_replicate: what the FSDP2 engine refuses, with the fix named."""

from __future__ import annotations

import re

import pytest
import torch

from fp8shard.train.config import ConfigError, load_config

CASES = [
    (["model.optim.name=adamw", "model.fp8_params=false"], 2,
     "model.optim.name must stay distributed_fused_adam"),
    ([], 1, "launch with torchrun --nproc-per-node N"),
    (["trainer.compile=true"], 2, "set trainer.compile=false"),
    (["model.optim.overlap_param_sync=true"], 2, "overlap_param_sync does not apply"),
    (["model.optim.grad_sync_dtype=fp32"], 2, "set model.params_dtype=fp32"),
    (["trainer.hsdp_replicate=3", "model.micro_batch_size=4"], 4, "must be >= 1 and divide the 4 rank"),
]


@pytest.mark.parametrize(("overrides", "world", "message"), CASES)
def test_fsdp2_refusals(overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["trainer.strategy=fsdp2", *overrides], world_size=world)


def test_hsdp_needs_fsdp2():
    with pytest.raises(ConfigError, match=r"trainer\.hsdp_replicate needs trainer\.strategy=fsdp2"):
        load_config(["trainer.hsdp_replicate=2"], world_size=2)


def test_valid_fsdp2_configs():
    cfg = load_config(["trainer.strategy=fsdp2", "trainer.hsdp_replicate=2", "model.micro_batch_size=4"],
                      world_size=4)
    assert (cfg.trainer.strategy, cfg.trainer.hsdp_replicate) == ("fsdp2", 2)
    cfg = load_config(["trainer.strategy=fsdp2", "model.params_dtype=fp32",
                       "model.optim.grad_sync_dtype=fp32"], world_size=2)
    assert cfg.trainer.strategy == "fsdp2"
    with pytest.raises(ConfigError, match=r"trainer\.strategy"):
        load_config(["trainer.strategy=ddp"], world_size=2)


TILED = ["trainer.strategy=fsdp2", "model.fp8=true", "model.fp8_params=true"]


def test_rowwise_and_blockwise_fp8_weights_train_with_fsdp2():
    """They shard when every block projection cuts into whole tiles over the shard ranks."""
    cfg = load_config([*TILED, "model.fp8_recipe=rowwise"], world_size=2)
    assert (cfg.trainer.strategy, cfg.model.fp8_recipe) == ("fsdp2", "rowwise")
    cfg = load_config([*TILED, "model.fp8_recipe=blockwise", "model.hidden_size=256",
                       "model.ffn_hidden_size=512"], world_size=2)
    assert (cfg.trainer.strategy, cfg.model.fp8_recipe) == ("fsdp2", "blockwise")


@pytest.mark.parametrize(("overrides", "world", "message"), [
    # 128 rows of proj over 2 ranks: 64 each, half a 128-row band
    (["model.fp8_recipe=blockwise", "model.hidden_size=128", "model.ffn_hidden_size=512"], 2,
     "blockwise (128x128 blocks) FP8 weight qkv of shape (384, 128): FSDP2 over 2 shard ranks gives each "
     "rank 192 rows, not a multiple of 128"),
    # HSDP: the shard dimension is what counts (4 ranks, 2 replicas: 2 shards of whole bands fit)
    (["model.fp8_recipe=blockwise", "model.hidden_size=256", "model.ffn_hidden_size=512",
      "model.micro_batch_size=4"], 4,
     "FP8 weight qkv of shape (768, 256): FSDP2 over 4 shard ranks gives each rank 192 rows"),
    (["model.fp8_recipe=rowwise", "model.hidden_size=30", "model.num_attention_heads=2",
      "model.ffn_hidden_size=64", "model.micro_batch_size=4"], 4,
     "rowwise FP8 weight qkv of shape (90, 30): FSDP2 over 4 shard ranks cuts its 90 rows unevenly"),
])
def test_tiled_fp8_weights_that_do_not_cut_into_whole_tiles_are_refused(overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_config([*TILED, *overrides], world_size=world)
    assert "trainer.strategy=flat" in str(e.value) and "model.fp8_recipe=current" in str(e.value)
    if "hidden_size=256" in overrides[1]:  # the HSDP fix works
        load_config([*TILED, *overrides, "trainer.hsdp_replicate=2"], world_size=world)


class Mesh:
    """What fully_shard_model reads of a device mesh before it shards anything."""

    def __init__(self, n: int) -> None:
        self.n, self.ndim = n, 1

    def size(self, dim: int = 0) -> int:
        return self.n


@pytest.mark.parametrize(("recipe", "out_features", "world", "message"), [
    ("blockwise", 256, 4, r"FP8 weight '0.weight' of shape \(256, 16\): FSDP2 over 4 shard ranks gives each "
                          r"rank 64 rows, not a multiple of 128.*shard world sizes that fit: 2\b"),
    ("rowwise", 30, 4, r"rowwise FP8 weight '0.weight' of shape \(30, 16\): FSDP2 over 4 shard ranks cuts "
                       r"its 30 rows unevenly.*shard world sizes that fit: 2, 3, 5, 6, 10, 15, 30"),
])
def test_fully_shard_model_refuses_tiled_weights_it_cannot_cut(recipe, out_features, world, message):
    import fp8shard as fs
    from fp8shard.optim.fsdp2 import fully_shard_model

    with fs.fp8_model_init(recipe=recipe):
        model = torch.nn.Sequential(fs.nn.Linear(16, out_features))
    with pytest.raises(ValueError, match=message + r".*trainer\.strategy=flat.*model\.fp8_recipe=current"):
        fully_shard_model(model, Mesh(world))

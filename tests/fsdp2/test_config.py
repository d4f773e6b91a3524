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


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fully_shard_model_refuses_tiled_fp8_weights(recipe):
    import fp8shard as fs
    from fp8shard.optim.fsdp2 import fully_shard_model

    with fs.fp8_model_init(recipe=recipe):
        model = torch.nn.Sequential(fs.nn.Linear(16, 32))
    with pytest.raises(ValueError, match=r"FSDP2 shards per-tensor FP8 weights only.*trainer.strategy=flat"):
        fully_shard_model(model)

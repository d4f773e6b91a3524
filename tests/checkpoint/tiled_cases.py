"""What every rank runs in the checkpoint tests of rowwise and blockwise FP8 weights
(module-level, so pool workers can import it): a tiny GPT whose block weights are stored with
one scale per row or per 128x128 block, trained with ``DistributedFusedAdam``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import fp8shard as fs
from fp8shard.checkpoint import load_checkpoint, save_checkpoint
from fp8shard.fp8 import Float8Tensor
from fp8shard.models import GPT, GPTConfig
from fp8shard.optim import DistributedFusedAdam
from tests.checkpoint.cases import batch, digest, optimizer_digest, rank_world

TINY_BUCKET_MB = 3000 * 4 / 2**20  # parameters straddle buckets


def build(recipe: str, seed: int = 0) -> tuple[GPT, DistributedFusedAdam]:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, max_position_embeddings=8, num_layers=2, hidden_size=64,
                    ffn_hidden_size=256, num_attention_heads=2)  # 192x64, 256x64: bands of 128 rows
    with fs.fp8_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        model = GPT(cfg)
    model = model.to(torch.bfloat16)
    opt = DistributedFusedAdam(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                               bucket_cap_mb=TINY_BUCKET_MB)
    return model, opt


def train(model: GPT, opt: DistributedFusedAdam, recipe: str, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        x, y = batch(step)
        with fs.fp8_autocast(recipe=recipe):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / rank_world()[1])
    return losses


def model_digests(model: GPT) -> dict[str, str]:
    """Per entry: FP8 bytes + the scale grid (its shape too), or the raw bytes."""
    out = {}
    for n, t in model.state_dict().items():
        if isinstance(t, Float8Tensor):
            out[n] = f"{digest(t.uint8_view())}{digest(t.scale_inv)}{tuple(t.scale_inv.shape)}{t.block}"
        else:
            out[n] = digest(t)
    return out


def state(model: GPT, opt: DistributedFusedAdam) -> dict[str, Any]:
    return {"model": model_digests(model), "optim": optimizer_digest(opt)}


def run_save(path: str, recipe: str, steps: int) -> dict[str, Any]:
    model, opt = build(recipe)
    losses = train(model, opt, recipe, 0, steps)
    save_checkpoint(path, model, opt, step=steps)
    return {"losses": losses, **state(model, opt)}


def run_straight(recipe: str, steps: int) -> dict[str, Any]:
    model, opt = build(recipe)
    return {"losses": train(model, opt, recipe, 0, steps), **state(model, opt)}


def run_load(path: str, recipe: str, first: int = 0, last: int = 0) -> dict[str, Any]:
    """A fresh model of another seed, loaded; then steps ``first..last-1``."""
    model, opt = build(recipe, seed=99)
    load_checkpoint(path, model, opt)
    loaded = state(model, opt)
    losses = train(model, opt, recipe, first, last)
    return {"loaded": loaded, "losses": losses, **state(model, opt)}

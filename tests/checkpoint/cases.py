"""What every rank runs in the checkpoint tests (module-level, so pool workers can import it).

A tiny GPT with FP8 block weights (E4M3 ``Float8Tensor``), bf16 embeddings and norms,
delayed-scaling amax histories in the FP8 layers, trained with ``DistributedFusedAdam`` on a
global batch that is split over the ranks (the same global batch at any world size).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fp8shard as fs
from fp8shard.checkpoint import load_checkpoint, save_checkpoint
from fp8shard.fp8 import Float8Tensor
from fp8shard.models import GPT, GPTConfig
from fp8shard.optim import DistributedFusedAdam

SEQ, GLOBAL_ROWS, VOCAB = 8, 6, 64
TINY_BUCKET_MB = 1000 * 4 / 2**20  # a few thousand elements: parameters straddle buckets


def rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_model(seed: int = 0, fp8: bool = True) -> GPT:
    """A fresh tiny GPT (bf16; FP8 block weights with ``fp8``); ``seed`` changes every value."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, num_layers=2, hidden_size=32,
                    ffn_hidden_size=64, num_attention_heads=2)
    with fs.fp8_model_init(enabled=fp8, preserve_high_precision_init_val=True):
        model = GPT(cfg)
    return model.to(torch.bfloat16)


def build(seed: int = 0, fp8: bool = True, grad_sync: torch.dtype = torch.bfloat16,
          scaling: str = "current") -> tuple[GPT, DistributedFusedAdam]:
    """A fresh model and its DistributedFusedAdam."""
    model = build_model(seed, fp8)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = DistributedFusedAdam(groups,
                               lr=3e-3, betas=(0.9, 0.95), bucket_cap_mb=TINY_BUCKET_MB,
                               grad_sync_dtype=grad_sync, fp8_weight_scaling=scaling)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of global batch ``step`` (contiguous slice of GLOBAL_ROWS rows)."""
    rank, world = rank_world()
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=g)
    per = GLOBAL_ROWS // world
    mine = tokens[rank * per:(rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def train(model: GPT, opt: DistributedFusedAdam, first: int, last: int, fp8: bool = True) -> list[float]:
    """Steps ``first..last-1``; returns each step's loss averaged over the ranks (as an fp32)."""
    recipe = fs.DelayedScaling(amax_history_len=4)
    sync = fs.nn.AmaxSync(model) if fp8 else None  # over every rank of the pool
    losses = []
    for step in range(first, last):
        x, y = batch(step)
        with fs.fp8_autocast(enabled=fp8, recipe=recipe):
            loss = model(x, y)
        loss.backward()
        if sync is not None:
            sync.step()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / rank_world()[1])
    return losses


def digest(t: torch.Tensor) -> str:
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def model_digests(model: GPT) -> dict[str, str]:
    """Per entry of the state dict: FP8 bytes + scale, or the raw bytes (amax histories included)."""
    out = {}
    for n, t in model.state_dict().items():
        if isinstance(t, Float8Tensor):
            out[n] = digest(t.uint8_view()) + digest(t.scale_inv.reshape(1))
        else:
            out[n] = digest(t)
    return out


def optimizer_full(opt: DistributedFusedAdam) -> dict[int, dict[str, torch.Tensor]]:
    """Model-space optimizer state, gathered (the optimizer's own ``state_dict``)."""
    sd = opt.state_dict()
    return {i: {k: v for k, v in st.items() if k != "fp8"} | dict(st.get("fp8", {}).items())
            for i, st in sd["state"].items()} | {-1: {"step": torch.tensor(sd["step"])}}


def optimizer_digest(opt: DistributedFusedAdam) -> str:
    h = hashlib.sha256()
    for i, st in sorted(optimizer_full(opt).items()):
        for k in sorted(st):
            h.update(f"{i}/{k}".encode())
            h.update(digest(st[k]).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- what ranks run
def run_straight(steps: int, **kw: Any) -> dict[str, Any]:
    model, opt = build(**kw)
    losses = train(model, opt, 0, steps, kw.get("fp8", True))
    return {"losses": losses, "model": model_digests(model), "optim": optimizer_digest(opt)}


def run_save(path: str, steps: int, **kw: Any) -> dict[str, Any]:
    """Train ``steps`` steps and save; returns digests of what was saved."""
    model, opt = build(**kw)
    losses = train(model, opt, 0, steps, kw.get("fp8", True))
    save_checkpoint(path, model, opt, extra={"step": steps, "note": "hello"}, step=steps)
    return {"losses": losses, "model": model_digests(model), "optim": optimizer_digest(opt)}


def run_resume(path: str, first: int, last: int, **kw: Any) -> dict[str, Any]:
    """A fresh model (other seed) and optimizer, load, check, then train ``first..last-1``."""
    model, opt = build(seed=99, **kw)
    info = load_checkpoint(path, model, opt)
    loaded = {"model": model_digests(model), "optim": optimizer_digest(opt)}
    losses = train(model, opt, first, last, kw.get("fp8", True))
    return {"info": (info.step, info.world_size, info.extra, info.rng_restored), "loaded": loaded,
            "losses": losses, "model": model_digests(model), "optim": optimizer_digest(opt),
            "master": {i: st["master"] for i, st in optimizer_full(opt).items() if i >= 0}}


def run_full_master(steps: int, **kw: Any) -> dict[int, torch.Tensor]:
    model, opt = build(**kw)
    train(model, opt, 0, steps, kw.get("fp8", True))
    return {i: st["master"] for i, st in optimizer_full(opt).items() if i >= 0}


def files_of(path: str) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir())


def masters_by_name(model: GPT, opt: DistributedFusedAdam) -> dict[str, torch.Tensor]:
    """The optimizer's FP32 masters (flattened), keyed by the model's parameter names."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    return {order[i]: st["master"].reshape(-1) for i, st in opt.state_dict()["state"].items()}

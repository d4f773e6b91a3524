"""What every rank runs in the FSDP2 engine tests (module-level, so the workers can import it).

The model is a small GPT with FP8 weights built as ``python -m fp8shard.train`` builds it
(``build_model``: fp32 init, quantized, high-precision init value preserved; bf16 elsewhere).
Every rank draws the same global batch and takes its own rows, so the flat engine and FSDP2
see the same data at any world size.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import fp8shard as fs
from fp8shard.fp8 import Float8Tensor
from fp8shard.models import GPT
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim.fsdp2 import FSDP2Adam, default_mesh, fully_shard_model
from fp8shard.train.builders import build_model, param_groups
from fp8shard.train.config import load_config

VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 8
OVERRIDES = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
             "model.num_attention_heads=2", "model.encoder_seq_length=16", "model.fp8=true",
             "model.fp8_params=true", "trainer.precision=bf16-mixed", "model.params_dtype=bf16"]


def make_model() -> GPT:
    cfg = load_config(OVERRIDES, validate_cfg=False)
    return build_model(cfg, VOCAB, torch.device("cpu"))


def make_opt(model: torch.nn.Module, engine: str, lr: float = 1e-2) -> torch.optim.Optimizer:
    groups = param_groups(model, 0.1)
    if engine == "flat":
        return DistributedFusedAdam(groups, lr=lr, weight_decay=0.1)
    return FSDP2Adam(groups, lr=lr, weight_decay=0.1)


def shard(model: GPT, replicate: int = 1) -> GPT:
    return fully_shard_model(model, default_mesh(replicate))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_BATCH // world
    mine = tokens[rank * rows:(rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


def train_steps(model: GPT, opt: torch.optim.Optimizer, steps: range, clip: float = 0.0) -> list[float]:
    """Losses (averaged over ranks) of ``steps``; every step one forward, backward and update."""
    losses = []
    recipe = fs.DelayedScaling()
    for step in steps:
        x, y = batch(step)
        with fs.fp8_autocast(enabled=True, recipe=recipe), torch.autocast("cpu", torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        if clip:
            opt.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def run_losses(engine: str, steps: int, replicate: int = 1, clip: float = 0.0) -> list[float]:
    torch.manual_seed(0)
    model = make_model()
    if engine == "fsdp2":
        shard(model, replicate)
    opt = make_opt(model, engine)
    return train_steps(model, opt, range(steps), clip)


def fp8_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters()
               if isinstance(p.to_local() if hasattr(p, "to_local") else p, Float8Tensor))


def memory_per_fp8_elem(steps: int = 2) -> dict[str, float]:
    model = shard(make_model())
    opt = make_opt(model, "fsdp2")
    train_steps(model, opt, range(steps))
    x, y = batch(steps)
    with fs.fp8_autocast(enabled=True, recipe=fs.DelayedScaling()):
        model(x, y).backward()  # the gradient shards exist until the next step
    rep = opt.memory_report()
    n = fp8_numel(model)
    # Count only the FP8 weights' own bytes (the report covers all parameters).
    fp8_bytes = {"weights": 0, "grads": 0, "master": 0, "states": 0}
    for i, p in enumerate(opt._params):
        local = p.to_local()
        if isinstance(local, Float8Tensor):
            fp8_bytes["weights"] += local.numel()
            fp8_bytes["grads"] += p.grad.to_local().numel() * p.grad.to_local().element_size()
            fp8_bytes["master"] += opt.master[i].numel() * 4
            fp8_bytes["states"] += opt.exp_avg[i].numel() * 4 * 2
    out = {k: v / n for k, v in fp8_bytes.items()}
    out["report_total"] = rep["total"]
    out["world"] = dist.get_world_size()
    return out


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=0, abs_tol=0)

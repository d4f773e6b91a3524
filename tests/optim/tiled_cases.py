"""What every rank runs in tests/optim/test_tiled_weights.py (module-level, for pool workers).

Every rank computes the same batch, and the reference -- ``adam_`` on the fp32 init value with
the averaged gradient, then the recipe's quantization of the result -- takes that average
itself: two processes need not round the same matmul alike (a CPU kernel may block differently
by the alignment of its buffers), so a rank's own gradient can differ from the other's in the
last bit. At two ranks the fp32 average (a + b) / 2 is exact whatever the order, so the
optimizer's reduce-scatter and the reference's all-reduce agree bit for bit.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

import fp8shard as fs
from fp8shard.fp8 import Float8Tensor, Fp8Format
from fp8shard.fp8.quantizer import is_tiled, parse_recipe
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim.fused_step import adam_

SHAPES = ((300, 200), (130, 300), (64, 130))  # partial 128-row bands, rows shorter than a band
# Weights of one row length side by side (one input, outputs concatenated): neighbours in the
# optimizer's regions that its reference kernel joins into one 2-D view, where the bands allow.
SIDE_BY_SIDE = ((256, 96), (384, 96), (200, 96), (128, 96), (64, 96), (130, 96))
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


class SideBySide(torch.nn.ModuleList):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self], dim=1)


def build(recipe: str, seed: int = 0, shapes: tuple[tuple[int, int], ...] = SHAPES) -> torch.nn.Module:
    torch.manual_seed(seed)
    tiled = is_tiled(parse_recipe(recipe))
    with fs.fp8_model_init(recipe=recipe if tiled else None, preserve_high_precision_init_val=True):
        layers = [fs.nn.Linear(i, o) for o, i in shapes]
    chained = all(a[0] == b[1] for a, b in itertools.pairwise(shapes))  # each output feeds the next
    return torch.nn.Sequential(*layers) if chained else SideBySide(layers)


def one_step_against_reference(recipe: str, bucket_cap_mb: float,
                               shapes: tuple[tuple[int, int], ...] = SHAPES) -> dict[str, Any]:
    """One step; per FP8 weight whether its bytes and scales equal the recipe's quantization of
    the reference master, the wire bytes of the step, and the reference kernel's pieces of
    weights (as the layout cuts them, and as its quantizers' calls see them)."""
    model = build(recipe, shapes=shapes)
    fp8 = {n: p for n, p in model.named_parameters() if isinstance(p, Float8Tensor)}
    init = {n: p.get_high_precision_init_val().float().clone() for n, p in fp8.items()}
    init_scale_inv = {n: p.scale_inv.clone() for n, p in fp8.items()}
    grads: dict[str, torch.Tensor] = {}
    for n, p in fp8.items():
        p.register_hook(lambda g, n=n: grads.__setitem__(n, g.detach().float().clone()))
    opt = DistributedFusedAdam(model.parameters(), lr=HP["lr"], weight_decay=HP["weight_decay"],
                               bucket_cap_mb=bucket_cap_mb, grad_sync_dtype=torch.float32,
                               fp8_weight_scaling="delayed" if recipe == "delayed" else "current")
    x = torch.randn(16, shapes[0][1], generator=torch.Generator().manual_seed(7))
    with fs.fp8_autocast(recipe=recipe):
        model(x).square().mean().backward()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        for g in grads.values():
            torch.distributed.all_reduce(g)
            g /= torch.distributed.get_world_size()
    opt.step()
    out = {}
    for n, p in fp8.items():
        master = init[n].clone()
        adam_([master], [grads[n]], [torch.zeros_like(master)], [torch.zeros_like(master)], step=1,
              decoupled_weight_decay=True, **HP)
        if recipe == "delayed":  # the first cast uses the scale the weight was built with
            ref = Float8Tensor.quantize(master, Fp8Format.E4M3, scale=init_scale_inv[n].reciprocal())
        else:
            ref = Float8Tensor.quantize(master, Fp8Format.E4M3, recipe=recipe)
        out[n] = (torch.equal(p.uint8_view(), ref.uint8_view()) and torch.equal(p.scale_inv, ref.scale_inv)
                  and p.block == ref.block)
    weights = sum(p.numel() for p in fp8.values())
    comm = opt.comm_report()
    gathered = sum(v for k, v in comm.items() if k.startswith("all_gather.params.float8"))
    wire = gathered + comm["all_reduce.amax"]
    fp8_regions = [rb for rb in opt.engine.regions if rb.is_fp8 and rb.pieces]
    pieces = (sum(len(rb.pieces) for rb in fp8_regions),
              sum(len(opt.engine.fp8._plan(rb)[0]) for rb in fp8_regions))
    return {"equal": out, "bytes_per_weight": wire / weights, "kernel": type(opt.engine.kernel).__name__,
            "pieces": pieces}

"""The FSDP2 engine against the flat engine: losses, bytes on the wire, persistent memory, time.

    torchrun --nproc-per-node N benchmarks/bench_fsdp2.py [--steps 20] [--replicate R]
                                                          [--out FILE.json]

gloo on CPU (NCCL with one GPU per rank when CUDA is there). Two parts:

* **wire**: a stack of FP8 linears (no bias: every gathered byte is a weight's), one training
  step after another, the parameter all-gathers counted on the wire
  (``fp8shard.testing.fsdp_wire``): bytes gathered per weight element per gather, for the FSDP2
  engine with FP8 weights, FSDP2 with bf16 weights (what FSDP2 moves without the extension), and
  the flat engine (its ``comm_report``: the all-gather and the amax all-reduce); and with
  rowwise and blockwise FP8 weights (their scales counted too; blockwise on FSDP2 only where
  each rank gets whole 128-row bands, else null).
* **train**: the small GPT of ``python -m fp8shard.train`` (FP8 weights, bf16 elsewhere),
  ``--steps`` steps with each engine on the same global batches: the largest relative loss
  difference from the flat engine, the persistent bytes per FP8 weight element on a rank (weight,
  gradient, master + Adam states), and the median step time.

``--replicate R`` (R divides N) adds an HSDP row (R replicas x N/R shards; its memory target
takes N/R, the ranks that share one weight). Rank 0 prints the table and writes the JSON to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import fp8shard as fs
from fp8shard.fp8 import Float8Tensor
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim.fsdp2 import FSDP2Adam, default_mesh, fully_shard_model, local_shard
from fp8shard.testing.fsdp_wire import count_fsdp_wire
from fp8shard.train.builders import build_model, param_groups
from fp8shard.train.config import load_config

VOCAB, SEQ, GLOBAL_BATCH = 256, 64, 16
GPT = ["model.num_layers=4", "model.hidden_size=128", "model.ffn_hidden_size=512",
       "model.num_attention_heads=4", "model.encoder_seq_length=64", "model.fp8=true",
       "model.fp8_params=true", "trainer.precision=bf16-mixed", "model.params_dtype=bf16"]


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------- wire
class Stack(nn.Module):
    def __init__(self, fp8: bool, device: torch.device, width: int = 256, recipe: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        with fs.fp8_model_init(enabled=fp8, recipe=recipe), torch.device(device):
            self.layers = nn.ModuleList([fs.nn.Linear(width, width, bias=False) for _ in range(4)])
        if not fp8:
            for p in self.parameters():
                p.data = p.data.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


RECIPES = {None: fs.DelayedScaling, "rowwise": fs.RowwiseScaling, "blockwise": fs.BlockwiseScaling}


def wire(engine: str, fp8: bool, steps: int = 3, recipe: str | None = None) -> float:
    """Parameter all-gather bytes per weight element per gather (FSDP2: bytes and, for rowwise or
    blockwise weights, the scale grid rows; flat: its all-gather and the amax all-reduce that
    carries the scales)."""
    device = _device()
    model = Stack(fp8, device, recipe=recipe)
    numel = sum(p.numel() for p in model.parameters())
    if engine == "fsdp2":
        fully_shard_model(model, default_mesh(), reshard_after_forward=False)  # one gather per step
        count = count_fsdp_wire(model)
        opt: torch.optim.Optimizer = FSDP2Adam(model.parameters(), lr=1e-3)
    else:
        opt = DistributedFusedAdam(model.parameters(), lr=1e-3)
    gathered = 0
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(32, 256, generator=g).to(device, torch.bfloat16 if not fp8 else torch.float32)
        with fs.fp8_autocast(enabled=True, recipe=RECIPES[recipe]()):
            model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if engine == "flat":
            gathered += sum(v for k, v in opt.comm_report().items()
                            if k.startswith(("all_gather.params", "all_reduce.amax")))
    if engine == "fsdp2":
        gathered = count.total("all_gather.params")
    return gathered / (numel * steps)


# ---------------------------------------------------------------------------- train
def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + 7 * torch.arange(SEQ + 1)) % VOCAB
    rows = GLOBAL_BATCH // dist.get_world_size()
    mine = tokens[dist.get_rank() * rows:(dist.get_rank() + 1) * rows].to(device)
    return mine[:, :-1], mine[:, 1:]


def persistent_per_fp8_elem(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Bytes on this rank per FP8 weight element: the weight, its gradient, master and states."""
    if isinstance(opt, FSDP2Adam):
        total, numel = 0, 0
        for i, p in enumerate(opt._params):
            local = local_shard(p)
            if isinstance(local, Float8Tensor):
                numel += p.numel()
                grad = local_shard(p.grad) if p.grad is not None else None
                total += local.numel() + (grad.numel() * grad.element_size() if grad is not None else 0)
                states = 2 * opt.engine.exp_avg[i].numel() * opt.engine.exp_avg[i].element_size()
                total += opt.engine.master[i].numel() * 4 + states
        return total / numel
    # The flat engine's buffers hold every parameter; the FP8 region is the FP8 weights'.
    total, numel = 0, 0
    for rb in opt.engine.regions:
        if rb.is_fp8:
            numel += sum(pr.numel for pr in rb.layout.params)
            total += sum(v for k, v in rb.nbytes().items() if k != "other_weights")
    return total / numel


def train(engine: str, steps: int, replicate: int = 1) -> dict[str, object]:
    device = _device()
    cfg = load_config(GPT, validate_cfg=False)
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, device)
    if engine == "fsdp2":
        fully_shard_model(model, default_mesh(replicate))
        opt: torch.optim.Optimizer = FSDP2Adam(param_groups(model, 0.1), lr=3e-3, weight_decay=0.1,
                                               module=model)
    else:
        opt = DistributedFusedAdam(param_groups(model, 0.1), lr=3e-3, weight_decay=0.1)
    losses, times, memory = [], [], 0.0
    for step in range(steps):
        x, y = batch(step, device)
        dist.barrier()
        t0 = time.perf_counter()
        with fs.fp8_autocast(enabled=True, recipe=fs.DelayedScaling()), \
                torch.autocast(device.type, torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        if step == steps - 1:
            memory = persistent_per_fp8_elem(model, opt)  # gradients held, before the step
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    shards = dist.get_world_size() // replicate  # the N of the memory target: ranks sharing a weight
    return {"losses": losses, "ms_per_step": 1e3 * statistics.median(times[2:] or times),
            "persistent_bytes_per_fp8_elem": memory, "shards": shards,
            "target_bytes_per_fp8_elem": 1 + 2 + 12 / shards + 2 / shards}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--replicate", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")) else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    n = dist.get_world_size()
    torch.set_num_threads(1)
    wire_rows: dict[str, float | None] = {
        "fsdp2, FP8 weights": wire("fsdp2", True), "fsdp2, bf16 weights": wire("fsdp2", False),
        "flat, FP8 weights": wire("flat", True)}
    for recipe in ("rowwise", "blockwise"):
        if recipe == "blockwise" and (256 // n) % 128:  # 128-row bands per rank: [Note: FSDP2 tiled weights]
            wire_rows[f"fsdp2, {recipe} FP8"] = None  # refused: a band would be cut between ranks
        else:
            wire_rows[f"fsdp2, {recipe} FP8"] = wire("fsdp2", True, recipe=recipe)
        wire_rows[f"flat, {recipe} FP8"] = wire("flat", True, recipe=recipe)
    runs = {"flat": train("flat", args.steps), "fsdp2": train("fsdp2", args.steps)}
    if args.replicate > 1:
        name = f"fsdp2 HSDP {args.replicate}x{n // args.replicate}"
        runs[name] = train("fsdp2", args.steps, args.replicate)
    ref = runs["flat"]["losses"]
    for r in runs.values():
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref, strict=True)]
        r["max_rel_loss_diff_vs_flat"] = max(diffs)
    if dist.get_rank() == 0:
        print(f"bench_fsdp2: {n} ranks, {backend}, torch {torch.__version__}, {args.steps} steps")
        print(f"{'all-gather (wire)':<24} {'B per weight elem per gather':>30}")
        for k, v in wire_rows.items():
            print(f"{k:<24} {'refused' if v is None else f'{v:.4f}':>30}")
        print(f"{'training (GPT)':<24} {'final loss':>10} {'max rel dloss':>14} {'B/FP8 elem':>11} "
              f"{'target 1+2+12/N+2/N':>20} {'ms/step':>9}")
        for k, r in runs.items():
            print(f"{k:<24} {r['losses'][-1]:>10.4f} {r['max_rel_loss_diff_vs_flat']:>14.2e} "
                  f"{r['persistent_bytes_per_fp8_elem']:>11.3f} {r['target_bytes_per_fp8_elem']:>20.3f} "
                  f"{r['ms_per_step']:>9.1f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world_size": n, "backend": backend, "torch": torch.__version__,
                           "host": platform.node(), "steps": args.steps, "wire_bytes_per_elem": wire_rows,
                           "train": runs}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

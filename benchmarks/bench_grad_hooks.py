"""What the flat engine's gradient hook costs the host, per parameter and micro-batch.

    python benchmarks/bench_grad_hooks.py [--params 148] [--numel 4096] [--reps 200] [--rounds 3]
                                          [--device cpu|cuda] [--out FILE.json]

Every micro-batch of the training command ends with one post-accumulate-grad hook per parameter
(``GradSync.accumulate``, [Note: gradient sync] in fp8shard/optim/flat.py): it adds the
gradient into the parameter's slot of the bucket and frees ``param.grad``. The 125M command runs
148 of them per micro-batch and its step is bound by the host (docs/performance.md, section 15).

Two arms, the same ``--params`` bf16 parameters of ``--numel`` elements and the same backward
(a sum of each parameter times a constant, so that the backward is little else than the
gradients' accumulation):

  autograd  the parameters' own ``.grad`` (autograd accumulates the later micro-batches in place)
  engine    ``DistributedFusedAdam``'s hooks, inside ``no_sync`` (the micro-batches before the
            last: no reduce-scatter, only the add into the bucket)

Host ms per backward (the first quartile of ``--reps``, the best of ``--rounds`` alternating
rounds: the machines are shared) and the engine's extra microseconds per parameter.
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch

from fp8shard.optim import DistributedFusedAdam
from timing import write_json


def _backward_ms(params: list[torch.nn.Parameter], reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        loss = torch.stack([(p * 1.0).sum() for p in params]).sum()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - t0)  # the host's return: launches, hooks, Python
    times.sort()
    return times[len(times) // 4] * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)

    def make() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.randn(args.numel, device=args.device, dtype=torch.bfloat16))
                for _ in range(args.params)]

    plain, hooked = make(), make()
    opt = DistributedFusedAdam(hooked, lr=1e-3)
    best = {"autograd": float("inf"), "engine": float("inf")}
    with opt.no_sync():
        _backward_ms(plain, 3, args.device)
        _backward_ms(hooked, 3, args.device)
        for _ in range(args.rounds):
            best["autograd"] = min(best["autograd"], _backward_ms(plain, args.reps, args.device))
            best["engine"] = min(best["engine"], _backward_ms(hooked, args.reps, args.device))
    extra_us = (best["engine"] - best["autograd"]) / args.params * 1e3
    return {"benchmark": "bench_grad_hooks", "torch": torch.__version__, "machine": platform.processor()
            or platform.machine(), "device": args.device, "params": args.params, "numel": args.numel,
            "backward_host_ms": best, "engine_extra_us_per_param": extra_us}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=148, help="parameters (the 125M GPT has 148)")
    ap.add_argument("--numel", type=int, default=4096, help="elements per parameter")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if min(args.params, args.numel, args.reps, args.rounds) < 1:
        ap.error("--params, --numel, --reps and --rounds must be >= 1")
    out = run(args)
    ms = out["backward_host_ms"]
    print(f"\none backward of {args.params} bf16 parameters x {args.numel} elements, host ms "
          f"({args.device}, torch {torch.__version__})")
    print(f"{'arm':28s} {'host ms':>9s}")
    print(f"{'autograd (.grad in place)':28s} {ms['autograd']:9.3f}")
    print(f"{'engine hooks (no_sync)':28s} {ms['engine']:9.3f}")
    print(f"engine extra per parameter: {out['engine_extra_us_per_param']:.2f} us")
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()

"""Where the time of one FP8 Linear forward + backward goes, kernel by kernel (bench_linear.py's step).

    python benchmarks/profile_linear.py [--quick] [--variants "fp8 current,fp8 params"]
                                        [--modes compile,eager] [--out FILE.json]

For each variant (bench_linear.py's names) and mode: the median step time, what Dynamo did
(frames compiled, graph breaks, recompilations: a healthy compiled layer is one frame, no
break, no recompilation), and the kernels of ``--steps`` profiled steps summed by name (calls
and time per step), largest first. On CPU the profile lists ATen ops, not kernels.
Set ``TORCH_LOGS=output_code`` to see the Inductor code behind the compiled rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any

import torch
from torch._inductor import metrics as inductor_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import _build
from timing import median_seconds


def _dynamo_counts() -> dict[str, int]:
    c = torch._dynamo.utils.counters
    return {"frames": int(c["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(c["graph_break"].values())),
            "recompiles": int(sum(v for k, v in c["recompiles"].items()))}


def _kernels(step: Any, device: str, steps: int) -> list[dict[str, Any]]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if device == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.device_time
        else:
            parent = e.cpu_parent
            if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
                continue
            us = e.cpu_time
        rows[e.name][0] += 1
        rows[e.name][1] += us
    out = [{"kernel": k, "calls": n / steps, "us": t / steps} for k, (n, t) in rows.items()]
    return sorted(out, key=lambda r: -r["us"])


def profile(variant: str, mode: str, tokens: int, in_f: int, out_f: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    ref = torch.nn.Linear(in_f, out_f, device=args.device, dtype=torch.bfloat16)
    x = torch.randn(tokens, in_f, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, out_f, device=args.device, dtype=torch.bfloat16)
    layer, ctx, after_backward = _build(variant, ref)
    if mode == "compile" and variant == "fp8 delayed":  # as bench_linear.py: state made beforehand
        import fp8shard as fs

        fs.nn.prepare_delayed_scaling(layer, fs.DelayedScaling())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    inductor_metrics.reset()
    model = torch.compile(layer, dynamic=False) if mode == "compile" else layer

    def step() -> None:
        with ctx():
            y = model(x)
        y.backward(dy)
        after_backward()  # delayed scaling: the amax update (AmaxSync.step)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    sec = median_seconds(step, args.device, args.warmup, args.reps)
    # Inductor's own count of the kernels it generated (GEMMs are extern calls, not counted)
    # and its estimate of their bytes read + written, summed over forward and backward graphs.
    generated = {"kernels": inductor_metrics.generated_kernel_count,
                 "bytes": inductor_metrics.num_bytes_accessed}
    kernels = _kernels(step, args.device, args.steps)
    return {"variant": variant, "mode": mode, "tokens": tokens, "in": in_f, "out": out_f,
            "ms": sec * 1e3, "dynamo": _dynamo_counts(), "inductor_generated": generated,
            "kernels_per_step": sum(r["calls"] for r in kernels), "kernels": kernels}


def main() -> None:
    # Inductor counts the bytes its graphs move only while this log is on (it prints them too).
    # (and only when it compiles: no FX graph cache hit).
    torch._logging.set_logs(inductor_metrics=True)
    torch._inductor.config.fx_graph_cache = False
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="CPU-sized shapes")
    ap.add_argument("--variants", default="fp8 current,fp8 params")
    ap.add_argument("--modes", default="compile")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--top", type=int, default=14, help="kernels printed per row")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = [(128, 256, 512)] if args.quick else [(8192, 4096, 14336), (8192, 14336, 4096)]
    rows = []
    for shape in shapes:
        for mode in args.modes.split(","):
            for variant in args.variants.split(","):
                r = profile(variant, mode, *shape, args)
                rows.append(r)
                gen = r["inductor_generated"]
                print(f"\n{r['tokens']}x{r['in']}->{r['out']} {mode} {variant}: {r['ms']:.3f} ms, "
                      f"{r['kernels_per_step']:.0f} kernels/step, dynamo {r['dynamo']}, Inductor "
                      f"generated {gen['kernels']} kernels moving {gen['bytes'] / 2**20:.1f} MiB")
                for k in r["kernels"][:args.top]:
                    print(f"  {k['us']:10.1f} us {k['calls']:5.1f}x  {k['kernel'][:110]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

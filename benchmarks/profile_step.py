"""Where the time of one GPT training step goes, per system, on one CUDA GPU.

    python benchmarks/profile_step.py [--systems fp8shard-fp8,fp8shard-bf16] [--steps 3]
                                      [--size 1b|125m] [--layers 24] [--out DIR]

The model, data and systems are compare_peers.py's (``--gpu`` configuration, world size 1 over
NCCL; any of its system names, e.g. ``fp8shard-fp8+compile`` or ``reference-bf16``). After
warm-up, ``--steps`` steps run under ``torch.profiler``; the CUDA kernels are summed by category
(name patterns below), and the step's wall time is compared with the time some kernel was
running: ``gpu busy`` well under 100% means the step waits on the host (launch overhead, Python),
not on the GPU. Phases (forward, backward, optimizer) are timed with CUDA
events in separate un-profiled steps. Prints one table per system; writes ``DIR/profile.json``,
``DIR/<system>_kernels.txt`` (the 40 most expensive kernels) and ``DIR/<system>_host.txt`` (one
step's Python functions under cProfile: where the host time goes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_peers as cp

# First match wins; matched against the lower-cased kernel name.
CATEGORIES = [
    ("comm (nccl)", r"nccl"),
    ("fp8 cast / transpose", r"float8_copy|triton_cast|quantize|fp8_cast"),
    ("gemm fp8", r"nvjet_sm90_q|qgmma|(gemm|cutlass|xmma).*(e4m3|e5m2)"),
    ("attention", r"flash|fmha|attention|sdpa|dot_do_o|convert_dq"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|hgmma"),
    # Before "triton": Inductor names its kernels triton_<kind>_fused_<ops>, which say nothing
    # about the optimizer; fp8shard's own Triton Adam kernels are named _adam_kernel/_cast_kernel.
    ("optimizer", r"adam|multi_tensor|foreach|_cast_kernel"),
    ("triton (fp8shard/inductor)", r"triton"),
    ("reduction (amax, norms)", r"reduce|norm|max|softmax|cross_entropy|nll"),
    ("copy / convert", r"copy|cast|convert|transpose|cat"),
    ("elementwise", r"elementwise|vectorized|unrolled|where|clamp|mul|add|div|fill"),
]


def categorize(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def _step(model, opt, ctx, x, y):
    loss = cp.step_loss(model, ctx, x, y)
    loss.backward()
    cp.after_backward(ctx)  # fp8shard-fp8, delayed scaling: the amax all-reduce and update
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _phases(model, opt, ctx, x, y, reps: int) -> dict[str, float]:
    """Median ms of forward, backward and optimizer step, timed with CUDA events."""
    out: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        loss = cp.step_loss(model, ctx, x, y)
        ev[1].record()
        loss.backward()
        cp.after_backward(ctx)  # the amax update counts in the backward phase
        ev[2].record()
        opt.step()
        ev[3].record()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        for k, (a, b) in zip(out, itertools.pairwise(ev), strict=True):
            out[k].append(a.elapsed_time(b))
    return {k: statistics.median(v) for k, v in out.items()}


def _host_profile(model, opt, ctx, x, y, path: str) -> None:
    """One more step under cProfile: the Python functions the host spends the step in (what the
    GPU waits for when ``gpu busy`` is low), by own time and by cumulative time. cProfile slows
    Python down about 2x: read the ranking, not the absolute times."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    _step(model, opt, ctx, x, y)
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    with open(path, "w") as f:
        f.write(out.getvalue())


def _file_stem(system: str) -> str:
    """A system name as a file name ("fp8shard-fp8+compile" -> "fp8shard-fp8_compile")."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", system)


def profile_system(system: str, cfg: dict, steps: int, out_dir: str) -> dict:
    device = torch.device("cuda", 0)
    model, opt, ctx, note = cp._build(system, cfg, device)
    batches = list(cp._batches(dict(cfg, steps=1), 0, 1, device))
    x, y = batches[0]
    for _ in range(cfg["warmup"]):
        _step(model, opt, ctx, x, y)
    torch.cuda.synchronize()
    phases = _phases(model, opt, ctx, x, y, reps=3)
    walls = []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _step(model, opt, ctx, x, y)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    _host_profile(model, opt, ctx, x, y, os.path.join(out_dir, f"{_file_stem(system)}_host.txt"))
    kernels: dict[str, tuple[float, int]] = {}
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0.0)
        if "#" in evt.key or evt.key.startswith(("Optimizer.", "ProfilerStep")):
            continue  # record_function annotations, shown on the GPU timeline too: not kernels
        if dev_us and evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.key] = (dev_us / steps / 1e3, evt.count // steps)
    by_cat: dict[str, list[float]] = {}
    for name, (ms, count) in kernels.items():
        c = by_cat.setdefault(categorize(name), [0.0, 0])
        c[0] += ms
        c[1] += count
    busy = sum(ms for ms, _ in kernels.values())
    wall_ms = statistics.median(walls) * 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:40]
    with open(os.path.join(out_dir, f"{_file_stem(system)}_kernels.txt"), "w") as f:
        for name, (ms, count) in top:
            f.write(f"{ms:9.3f} ms {count:6d}x  [{categorize(name)}]  {name[:160]}\n")
    del model, opt
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return {"system": system, "note": note, "wall_ms": wall_ms, "gpu_busy_ms": busy,
            "kernels_per_step": sum(c for _, c in kernels.values()), "phases_ms": phases,
            "by_category_ms": {k: v[0] for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][0])},
            "by_category_launches": {k: v[1] for k, v in by_cat.items()},
            "top_kernels": [{"name": n, "ms": ms, "count": c} for n, (ms, c) in top[:15]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="fp8shard-fp8,fp8shard-bf16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--size", choices=tuple(cp.GPU_SIZES), default="1b", help="compare_peers.py --size")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--recipe", choices=("delayed", "current"), default="delayed",
                    help="fp8shard-fp8's scaling recipe (compare_peers.py --recipe)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cfg = cp._config(argparse.Namespace(gpu=True, quick=False, steps=None, size=args.size,
                                        recipe=args.recipe))
    if args.layers:
        cfg["model"]["num_layers"] = args.layers
    os.makedirs(args.out, exist_ok=True)
    store = tempfile.mktemp(prefix="fp8shard_prof_")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows = [profile_system(s, cfg, args.steps, args.out) for s in args.systems.split(",") if s]
    dist.destroy_process_group()
    tokens = cfg["global_batch"] * cfg["seq_len"]
    print(f"profile_step: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"GPT {cfg['model']['num_layers']}x{cfg['model']['hidden_size']}, {tokens} tokens/step, "
          f"fp8 recipe {args.recipe}")
    for r in rows:
        ph = r["phases_ms"]
        print(f"\n{r['system']}: wall {r['wall_ms']:.1f} ms ({tokens / r['wall_ms'] * 1e3:,.0f} tok/s), "
              f"gpu busy {r['gpu_busy_ms']:.1f} ms ({r['gpu_busy_ms'] / r['wall_ms']:.0%}), "
              f"{r['kernels_per_step']} kernels/step; fwd {ph['forward']:.1f} / bwd {ph['backward']:.1f}"
              f" / opt {ph['optimizer']:.1f} ms")
        for cat, ms in r["by_category_ms"].items():
            print(f"  {cat:<30}{ms:>9.2f} ms {r['by_category_launches'][cat]:>7}x")
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"config": cfg, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

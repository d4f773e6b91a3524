"""Where the training command's step loses time with FP8-stored weights against bf16 ones.

    python benchmarks/profile_command.py [--config gpt_125m] [--steps 5] [--warmup 3] [--top 15]
                                         [--out FILE.json] [--trace DIR] [--set KEY=VALUE ...]

The command itself, not a harness around its builders: each arm builds the training command's
``Trainer`` (``fp8shard.train.loop``) from ``config=CONFIG`` and the ``--set`` overrides, in a
process of its own, and runs ``Trainer.train_step`` -- what ``fit`` runs for every step (the
micro-batches, clipping, the optimizer, the step's host reads), without the logging, validation
and checkpoints between steps. Arms:

  fp8   the config's own settings (FP8-stored weights where the config has them)
  bf16  the same with ``model.fp8=false model.fp8_params=false``

After ``--warmup`` steps, ``--steps`` steps are timed (wall, each from an idle device) and
``--steps`` more run under ``torch.profiler``. Per step: wall ms and tokens/s; on CUDA the GPU's
busy time (the sum of kernel times), kernel launches, and host syncs (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize``, synchronous ``cudaMemcpy``), the waits that
empty the launch queue of a host-bound step. Then the events whose per-step GPU time, host
(self CPU) time or count differ most between the arms. Prints the tables; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import run_child, write_json

ARMS = {"fp8": [], "bf16": ["model.fp8=false", "model.fp8_params=false"]}
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One arm in this process: the Trainer, its timed and profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    from fp8shard.train.config import load_config
    from fp8shard.train.distributed import init_distributed
    from fp8shard.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        preset = [] if args.config == "defaults" else [f"config={args.config}"]
        argv = [*preset, f"exp_manager.exp_dir={tmp}", f"exp_manager.name={args.child}",
                "exp_manager.plots=false", *args.set, *ARMS[args.child]]
        cfg = load_config(argv)
        env = init_distributed(cfg.trainer.accelerator, cfg.trainer.collective_timeout_s)
        trainer = Trainer(cfg, env)
        device = env.device
        try:
            t0 = time.perf_counter()
            trainer.train_step()
            _sync(device)
            first_s = time.perf_counter() - t0
            for _ in range(args.warmup - 1):
                trainer.train_step()
            wall = []
            for _ in range(args.steps):
                _sync(device)
                t0 = time.perf_counter()
                trainer.train_step()
                _sync(device)
                wall.append(time.perf_counter() - t0)
            peak_mib = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            _sync(device)
            with profile(activities=acts) as prof:
                for _ in range(args.steps if args.profile else 0):
                    trainer.train_step()
                _sync(device)
            if args.trace:
                prof.export_chrome_trace(os.path.join(args.trace, f"{args.child}.json"))
            fp8_weights = sum(1 for p in trainer.model.parameters() if type(p).__name__ == "Float8Tensor")
            step_ms = statistics.median(wall) * 1e3
            tokens = cfg.model.global_batch_size * cfg.model.encoder_seq_length // env.world_size
            events: dict[str, list[float]] = {}
            kernels = launches = 0
            busy_us = 0.0
            syncs: dict[str, float] = {}
            for e in prof.key_averages():
                dev_us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
                on_device = e.device_type == torch.autograd.DeviceType.CUDA
                if on_device and dev_us > 0 and "#" not in e.key:
                    busy_us += dev_us
                    launches += e.count
                    kernels += 1
                if e.key in SYNC_EVENTS:
                    syncs[e.key] = e.count / args.steps
                n = args.steps
                events[e.key] = [e.self_cpu_time_total / n, dev_us / n, e.count / n]
        finally:
            trainer.close()
    return {"arm": args.child, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "first_step_s": first_s, "peak_mib": peak_mib, "step_ms": step_ms,
            "tokens_per_s": tokens / (step_ms / 1e3),
            "gpu_busy_ms": busy_us / 1e3 / args.steps if device.type == "cuda" and args.profile else None,
            "launches": launches / args.steps if args.profile else None, "host_syncs": syncs,
            "fp8_weights": fp8_weights, "events": events}


def diffs(results: dict[str, dict[str, Any]], top: int) -> dict[str, list[dict[str, Any]]]:
    """Events by |fp8 - bf16| per step: GPU time, host (self CPU) time, count."""
    a, b = results["bf16"]["events"], results["fp8"]["events"]
    zero = [0.0, 0.0, 0.0]
    rows = [{"event": n, "bf16": a.get(n, zero), "fp8": b.get(n, zero)} for n in set(a) | set(b)]
    out = {}
    for i, what in enumerate(("host_us", "device_us", "count")):
        ranked = sorted(rows, key=lambda r: -abs(r["fp8"][i] - r["bf16"][i]))[:top]
        out[what] = [{"event": r["event"], "bf16": r["bf16"][i], "fp8": r["fp8"][i],
                      "diff": r["fp8"][i] - r["bf16"][i]} for r in ranked if r["fp8"][i] != r["bf16"][i]]
    return out


def report(results: dict[str, dict[str, Any]], d: dict[str, list[dict[str, Any]]], args) -> None:
    a, b = results["bf16"], results["fp8"]
    print(f"\nthe training command (config={args.config} {' '.join(args.set)}), per step, "
          f"{results['fp8']['device']}; medians of {args.steps} steps after {args.warmup}")

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:,.2f}"

    rows = [("step ms", a["step_ms"], b["step_ms"]), ("tokens/s", a["tokens_per_s"], b["tokens_per_s"]),
            ("GPU busy ms", a["gpu_busy_ms"], b["gpu_busy_ms"]),
            ("kernel launches", a["launches"], b["launches"]),
            ("FP8 weights", a["fp8_weights"], b["fp8_weights"]),
            ("peak MiB allocated", a["peak_mib"], b["peak_mib"]),
            ("first step s (compiles)", a["first_step_s"], b["first_step_s"])]
    for name in SYNC_EVENTS:
        if name in a["host_syncs"] or name in b["host_syncs"]:
            rows.append((name, a["host_syncs"].get(name, 0.0), b["host_syncs"].get(name, 0.0)))
    print(f"{'':26s} {'bf16':>12s} {'fp8':>12s} {'fp8 / bf16':>11s}")
    for name, x, y in rows:
        ratio = f"{y / x:11.3f}" if x and y is not None else f"{'':11s}"
        print(f"{name:26s} {fmt(x):>12s} {fmt(y):>12s} {ratio}")
    for what, unit in (("device_us", "GPU µs"), ("host_us", "host self µs"), ("count", "calls")):
        if not d[what]:
            continue
        print(f"\nper step, {unit}: the events that differ most")
        print(f"{'fp8 - bf16':>11s} {'bf16':>10s} {'fp8':>10s}  event")
        for r in d[what]:
            print(f"{r['diff']:11.1f} {r['bf16']:10.1f} {r['fp8']:10.1f}  {r['event'][:80]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpt_125m",
                    help="the command's preset (config=...); 'defaults': none, defaults.yaml alone")
    ap.add_argument("--set", nargs="*", default=[], help="more KEY=VALUE overrides, both arms")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (the first compiles)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="time the steps only (no profiled steps, no event tables)")
    ap.add_argument("--trace", default=None, help="a folder: each arm's profiled steps as a Chrome trace")
    ap.add_argument("--child", default=None, choices=list(ARMS), help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    if args.child is not None:
        print(json.dumps(child(args)), flush=True)
        return {}
    results = {arm: run_child(__file__, raw, arm) for arm in ARMS}
    d = diffs(results, args.top)
    report(results, d, args)
    out = {"benchmark": "profile_command", "torch": torch.__version__,
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
           "arms": {k: {kk: vv for kk, vv in v.items() if kk != "events"} for k, v in results.items()},
           "diffs": d}
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)

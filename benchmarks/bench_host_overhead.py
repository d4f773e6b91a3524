"""What a micro-batch costs the host with FP8-stored weights against bf16 ones.

    python benchmarks/bench_host_overhead.py [--width 16] [--layers 12] [--reps 200] [--rounds 3]
                                             [--profile] [--out FILE.json]
    python benchmarks/bench_host_overhead.py --gpu [--reps 30] [--profile] [--out FILE.json]

Two arms of the training command's model, built by ``fp8shard.train``'s own builders
(``build_model``, ``build_optimizer``, ``compile_model``; one process, DistributedFusedAdam at
world size 1, the whole GPT compiled as one graph: ``trainer.compile_scope=auto`` there):

  bf16  ``model.fp8=false model.fp8_params=false``: bf16 weights
  fp8   FP8-stored weights (``fp8_model_init``, current scaling), every block projection computing
        in bf16 from them (``fp8_compute=False``: what ``model.fp8_layers=auto`` picks on CUDA at
        GPT-2 small; on the CPU the filter does not apply, so it is set here): the weights are
        dequantized in the forward and again in the backward ([Note: grouped dequantize])

CPU mode: a 12-layer GPT of width ``--width`` on ``--seq`` tokens, where the compute is small and
the host's work (Dynamo's guards, AOTAutograd's wrappers, Inductor's generated Python, autograd,
the optimizer's gradient hooks) is most of the time. ``--gpu``: the same at the 125M shapes of
``config=gpt_125m`` (8 x 1024 tokens per micro-batch) on one CUDA device.

Each arm runs in a process of its own: the two models share code objects, so in one process
the second one's guard lookup would first fail the first one's cache entry (about 0.1 ms a call
on the CPU); ``--rounds`` alternates the arms' processes and takes the medians. Measured per arm,
medians after warm-up (``timing.host_and_wall_seconds``):
  forward     the compiled forward with its loss, under the command's contexts (bf16 autocast,
              fp8_autocast for fp8)
  backward    its backward (inside ``no_sync``: the gradients only accumulate)
  micro-batch forward + backward
  optimizer   ``clip_grad_norm`` + ``step()`` + ``zero_grad()`` after one micro-batch
  step        ``--micro-batches`` micro-batches (all but the last under ``no_sync``) + optimizer:
              the training command's ``train_step`` without its data
Each as host ms (the call's return; the device queue drained before each) and wall ms (CUDA: to
the device's end; on the CPU the same). ``--profile`` also records ``--profile-reps`` micro-batches
under ``torch.profiler`` (CPU activity) per arm and prints the events whose self time per
micro-batch differs most between the arms: where the FP8 arm's extra host time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import host_and_wall_seconds, run_child, write_json

ARMS = ("bf16", "fp8")
PHASES = ("forward", "backward", "micro-batch", "optimizer", "step")


def overrides(args: argparse.Namespace, arm: str) -> list[str]:
    """The training command's ``key=value`` overrides of ``arm`` at this run's shapes."""
    if args.gpu:  # config=gpt_125m's shapes and recipe
        shape = dict(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
                     encoder_seq_length=1024, micro_batch_size=8)
    else:
        shape = dict(num_layers=args.layers, hidden_size=args.width, ffn_hidden_size=4 * args.width,
                     num_attention_heads=args.heads, encoder_seq_length=args.seq,
                     micro_batch_size=args.micro_batch)
    out = [f"model.{k}={v}" for k, v in shape.items()]
    # CPU: no FP8 GEMM runs (no layer computes in FP8), so no one-time GEMM path measurement
    gemm = "auto" if args.gpu else "emulated"
    out += ["model.fp8_recipe=current", f"trainer.accelerator={'gpu' if args.gpu else 'cpu'}",
            f"trainer.num_threads={args.threads}", f"model.fp8_gemm={gemm}"]
    if arm == "bf16":
        out += ["model.fp8=false", "model.fp8_params=false"]
    return out


class Arm:
    """One arm's model, optimizer and batch, built as the training command builds them."""

    def __init__(self, args: argparse.Namespace, arm: str) -> None:
        from fp8shard import nn as fsnn
        from fp8shard.train.builders import (
            build_model,
            build_optimizer,
            build_recipe,
            compile_model,
            compile_scope_for,
            configure_compute,
        )
        from fp8shard.train.config import load_config
        from fp8shard.train.distributed import DistEnv

        self.device = torch.device("cuda" if args.gpu else "cpu")
        cfg = load_config(overrides(args, arm), validate_cfg=False)
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=self.device, backend=None)
        self.compute = configure_compute(cfg, env)
        self.model = build_model(cfg, args.vocab, self.device)
        self.fp8 = cfg.model.fp8
        if self.fp8:  # every projection computes in bf16 from its FP8 weight (fp8_layers=auto on CUDA)
            for layer in self.model.modules():
                if isinstance(layer, fsnn.Linear):
                    layer.fp8_compute = False
        self.opt, self.forward_module = build_optimizer(cfg, self.model, env)
        self.recipe = build_recipe(cfg)
        self.scope = compile_scope_for(cfg.trainer.compile_scope, 1)
        compile_model(self.model, self.recipe if self.fp8 else None, self.scope, args.backend)
        gen = torch.Generator().manual_seed(0)
        shape = (cfg.model.micro_batch_size, cfg.model.encoder_seq_length)
        self.x = torch.randint(0, args.vocab, shape, generator=gen).to(self.device)
        self.y = torch.randint(0, args.vocab, shape, generator=gen).to(self.device)
        self.micro_batches = args.micro_batches
        self.loss: torch.Tensor | None = None

    @contextlib.contextmanager
    def _ctx(self) -> Iterator[None]:
        """The training loop's forward contexts (``Trainer._forward_ctx``)."""
        import fp8shard as fs

        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            if not self.fp8:
                yield
                return
            with fs.fp8_autocast(enabled=True, recipe=self.recipe):
                yield

    def forward(self) -> None:
        with self._ctx():
            self.loss = self.forward_module(self.x, self.y)

    def backward(self) -> None:
        assert self.loss is not None
        with self.opt.no_sync():
            self.loss.backward()
        self.loss = None

    def micro_batch(self) -> None:
        with self.opt.no_sync():
            self.forward()
            assert self.loss is not None
            self.loss.backward()

    def optimizer(self) -> None:
        self.opt.clip_grad_norm(1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        for i in range(self.micro_batches):
            with self.opt.no_sync() if i < self.micro_batches - 1 else contextlib.nullcontext():
                self.forward()
                assert self.loss is not None
                (self.loss / self.micro_batches).backward()
        self.optimizer()


def measure(arm: Arm, args: argparse.Namespace) -> dict[str, dict[str, float | None]]:
    """Median host and wall ms of each phase (``PHASES``)."""
    dev = arm.device.type

    def both(fn: Callable[[], None], reps: int) -> dict[str, float]:
        host, wall = host_and_wall_seconds(fn, dev, warmup=args.warmup, reps=reps)
        return {"host_ms": host * 1e3, "wall_ms": wall * 1e3}

    def forward() -> float:
        t0 = time.perf_counter()
        arm.forward()
        t = time.perf_counter() - t0
        arm.backward()
        return t

    def backward() -> float:
        arm.forward()
        _sync(dev)
        t0 = time.perf_counter()
        arm.backward()
        return time.perf_counter() - t0

    def optimizer() -> float:
        arm.micro_batch()
        _sync(dev)
        t0 = time.perf_counter()
        arm.optimizer()
        return time.perf_counter() - t0

    out = {"micro-batch": both(arm.micro_batch, args.reps),
           "forward": _part(forward, dev, args.warmup, args.reps),
           "backward": _part(backward, dev, args.warmup, args.reps)}
    arm.opt.zero_grad(set_to_none=True)
    out["optimizer"] = _part(optimizer, dev, args.warmup, max(args.reps // 4, 3))
    out["step"] = both(arm.step, max(args.reps // (2 * args.micro_batches), 3))
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _part(fn: Callable[[], float], device: str, warmup: int, reps: int) -> dict[str, float | None]:
    """Median of the host seconds ``fn`` returns, those of the part of its work it times (the
    device queue drained before that part); its wall time is not separated (None)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        times.append(fn())
    _sync(device)
    return {"host_ms": statistics.median(times) * 1e3, "wall_ms": None}


def profile_events(arm: Arm, reps: int, windows: int = 5) -> dict[str, list[float]]:
    """Self and total host µs per micro-batch of each ``torch.profiler`` event (CPU activity), with
    calls per micro-batch: the median over ``windows`` profiled windows of ``reps / windows``
    micro-batches each (a machine shared with other work skews single windows); compiled graphs'
    hashed names made comparable across arms."""
    from torch.profiler import ProfilerActivity, profile

    per = max(reps // windows, 1)
    seen: dict[str, list[list[float]]] = {}
    for _ in range(windows):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(per):
                arm.micro_batch()
            _sync(arm.device.type)
        window: dict[str, list[float]] = {}
        for e in prof.key_averages():
            name = re.sub(r"CompiledFxGraph \w+", "CompiledFxGraph", e.key)
            name = re.sub(r"Region: \d+/\d+", "Region", name)
            if name in window:  # the forward's and the backward's compiled graphs, in order
                name += " (2)"
            window[name] = [e.self_cpu_time_total / per, e.cpu_time_total / per, e.count / per]
        for name, v in window.items():
            seen.setdefault(name, []).append(v)
    return {name: [statistics.median(v[i] for v in vals) for i in range(3)] for name, vals in seen.items()}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One arm in this process: its measurements (and events with ``--profile``)."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    arm = Arm(args, args.child)
    arm.micro_batch()  # compiles the forward and the backward
    _sync(arm.device.type)
    first_s = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    result: dict[str, Any] = {
        "arm": args.child, "first_call_s": first_s, "compile_scope": arm.scope,
        "step_kernel": type(arm.opt.engine.kernel).__name__,
        "fp8_weights": sum(type(p).__name__ == "Float8Tensor" for p in arm.model.parameters()),
        "params": sum(1 for _ in arm.model.parameters()),
        "phases": measure(arm, args),
    }
    result["graphs"] = int(counters["stats"]["unique_graphs"])
    if args.profile:
        result["events"] = profile_events(arm, args.profile_reps)
    return result


def _median_or_none(values: list[float | None]) -> float | None:
    return None if None in values else statistics.median(v for v in values if v is not None)


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's runs (``--rounds``) as one: the median of each figure, the rest from the first."""
    out = dict(runs[0])
    out["rounds"] = len(runs)
    out["phases"] = {phase: {k: _median_or_none([r["phases"][phase][k] for r in runs]) for k in values}
                     for phase, values in runs[0]["phases"].items()}
    if "events" in out:
        names = set().union(*(r["events"] for r in runs))
        zero = [0.0, 0.0, 0.0]
        out["events"] = {n: [statistics.median(r["events"].get(n, zero)[i] for r in runs) for i in range(3)]
                         for n in names}
    return out


def event_diffs(results: dict[str, dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """Events by |fp8 - bf16| self µs per micro-batch, largest first."""
    a, b = results["bf16"]["events"], results["fp8"]["events"]
    rows = []
    for name in set(a) | set(b):
        x, y = a.get(name, [0.0, 0.0, 0.0]), b.get(name, [0.0, 0.0, 0.0])
        rows.append({"event": name, "self_us_diff": y[0] - x[0], "bf16_self_us": x[0], "fp8_self_us": y[0],
                     "bf16_calls": x[2], "fp8_calls": y[2]})
    rows.sort(key=lambda r: -abs(r["self_us_diff"]))
    return rows[:top]


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    dev = "cuda" if args.gpu else "cpu"
    print(f"\nhost ms per call ({dev}; wall ms in brackets where the device runs apart), "
          f"medians of {args.reps} micro-batches, {args.rounds} process(es) per arm")
    print(f"{'phase':14s} {'bf16':>16s} {'fp8':>16s} {'fp8 - bf16':>11s} {'fp8 / bf16':>11s}")
    for phase in PHASES:
        a, b = results["bf16"]["phases"][phase], results["fp8"]["phases"][phase]

        def cell(p: dict[str, Any]) -> str:
            wall = p["wall_ms"]
            extra = f" [{wall:6.2f}]" if args.gpu and wall is not None else ""
            return f"{p['host_ms']:8.3f}{extra}"

        print(f"{phase:14s} {cell(a):>16s} {cell(b):>16s} {b['host_ms'] - a['host_ms']:11.3f} "
              f"{b['host_ms'] / a['host_ms']:11.3f}")
    for arm in ARMS:
        r = results[arm]
        print(f"{arm}: {r['params']} parameters ({r['fp8_weights']} FP8), {r['graphs']} graph(s) "
              f"compiled, scope {r['compile_scope']}, step kernel {r['step_kernel']}, first call "
              f"{r['first_call_s']:.1f} s")
    if args.profile:
        print(f"\nwhere the difference goes: torch.profiler self µs per micro-batch "
              f"({args.profile_reps} micro-batches each)")
        print(f"{'fp8 - bf16':>10s} {'bf16':>9s} {'fp8':>9s} {'calls':>13s}  event")
        for r in event_diffs(results, args.top):
            calls = f"{r['bf16_calls']:.0f}/{r['fp8_calls']:.0f}"
            print(f"{r['self_us_diff']:10.1f} {r['bf16_self_us']:9.1f} {r['fp8_self_us']:9.1f} "
                  f"{calls:>13s}  {r['event'][:70]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="125M shapes on one CUDA device")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=16, help="hidden size (CPU mode)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (CPU mode)")
    ap.add_argument("--vocab", type=int, default=None, help="default: 256 (CPU), 50304 (--gpu)")
    ap.add_argument("--micro-batches", type=int, default=8, help="per optimizer step (the command's 64/8)")
    ap.add_argument("--reps", type=int, default=None, help="timed micro-batches (default 200 CPU, 30 GPU)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="processes per arm, alternating (medians)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (trainer.num_threads)")
    ap.add_argument("--backend", default="inductor", help="trainer.compile_backend")
    ap.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS))
    ap.add_argument("--profile", action="store_true", help="also where the host time goes")
    ap.add_argument("--profile-reps", type=int, default=50)
    ap.add_argument("--top", type=int, default=20, help="profiler events listed")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if args.vocab is None:
        args.vocab = 50304 if args.gpu else 256
    if args.reps is None:
        args.reps = 30 if args.gpu else 200
    if args.gpu and not torch.cuda.is_available():
        ap.error("--gpu needs a CUDA device")
    if sorted(args.arms) != sorted(ARMS):
        ap.error(f"--arms: both of {', '.join(ARMS)} (the table compares them)")
    if args.child is not None:
        print(json.dumps(child(args)), flush=True)
        return {}
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):  # the arms alternate: a machine's load drifts over both alike
        for arm in ARMS:
            rounds[arm].append(run_child(__file__, raw, arm))
    results = {arm: combine(runs) for arm, runs in rounds.items()}
    report(results, args)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {"benchmark": "host_overhead", "device": torch.cuda.get_device_name() if args.gpu else "cpu",
           "cpu": cpu, "torch": torch.__version__,
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
           "arms": {k: {kk: vv for kk, vv in v.items() if kk != "events"} for k, v in results.items()}}
    if args.profile:
        out["event_diffs"] = event_diffs(results, args.top)
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)

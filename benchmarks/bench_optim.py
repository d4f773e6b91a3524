"""The distributed optimizer against DDP + AdamW and ZeroRedundancyOptimizer; and its step on a GPU.

    python benchmarks/bench_optim.py [--world-size 2] [--layers 4] [--dim 256] [--out FILE.json]
    python benchmarks/bench_optim.py --gpu [--params-m 256] [--out FILE.json]

CPU mode (gloo, ``--world-size`` ranks of a DistPool): a GPT-shaped stack of linear layers
(per layer: qkv d->3d, proj d->d, fc1 d->4d, fc2 4d->d, two norm weights), one iteration =
forward + backward + clip-free step on 8 x dim rows per rank. Variants:
  dfa fp8       DistributedFusedAdam, E4M3 weights (Float8Tensor), bf16 norms, bf16 grad sync
  dfa bf16      DistributedFusedAdam, bf16 weights, bf16 grad sync
  ddp adamw     fp32 weights, DDP (fp32 all-reduce), torch.optim.AdamW
  zero adamw    fp32 weights, DDP, torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
Columns: median iteration and ``step()`` seconds; bytes per step by collective (full buffer
sizes per rank, the convention of DistributedFusedAdam.comm_report(); for DDP counted by a comm
hook, for ZeRO the parameter broadcast is added as the parameter bytes, since its broadcasts are
not hookable) and what a ring algorithm sends per rank from those; persistent bytes per
parameter on rank 0 (weights, grads, master, states, padding).
CPU FP8 matmuls dequantize (emulation), so iteration times say little about FP8 speed; bytes
and memory are the point.

GPU mode (one CUDA device, world size 1, no forward): ``step()`` of DistributedFusedAdam on
FP8 weights (bf16 grads) and on bf16 weights, vs ``torch.optim.AdamW(fused=True)`` on fp32,
vs a device-to-device copy. Each DistributedFusedAdam variant runs on the PyTorch path
(``fused=False``: fp32 grad copy, torch's fused Adam kernel, amax, cast chain) and on the
fused Triton step ("triton": [Note: fused step] in fp8shard/optim/fused_step.py), the FP8 one
with current and with delayed weight scaling. Effective bandwidth counts the minimum bytes a
step must move: DFA-FP8 27 B/param (grad 2 read, master 4+4, m 4+4, v 4+4, FP8 weight 1
written), DFA-bf16 28, AdamW fp32 28 (param 4+4, grad 4, m 4+4, v 4+4); the copy counts bytes
read + written. "x AdamW" is the speed per parameter relative to AdamW(fused=True) (1.0: as fast).
With ``--profile`` each variant's last step also runs under torch.profiler and the script prints
where its time goes: the kernels by GPU time (with launches), the GPU busy time against the
step's wall time, and the host syncs (``cudaStreamSynchronize`` / ``.item()``) it made.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fp8shard.fp8 import Float8Tensor
from fp8shard.optim import DistributedFusedAdam
from timing import median_seconds

CPU_VARIANTS = ["dfa fp8", "dfa bf16", "ddp adamw", "zero adamw"]


# ============================================================================ model
class Block(nn.Module):
    """qkv, proj, fc1, fc2 and two norm weights: the parameter shapes of a GPT block."""

    def __init__(self, d: int, gen: torch.Generator) -> None:
        super().__init__()
        def w(o: int, i: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(o, i, generator=gen) / i**0.5)
        self.qkv, self.proj, self.fc1, self.fc2 = w(3 * d, d), w(d, d), w(4 * d, d), w(d, 4 * d)
        self.norm1 = nn.Parameter(torch.ones(d))
        self.norm2 = nn.Parameter(torch.ones(d))
        self.d = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def lin(t: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
            return t @ wt.to(t.dtype).t() if not isinstance(wt, Float8Tensor) else t @ wt.t()
        h = x * self.norm1.to(x.dtype)
        a = lin(h, self.qkv)[..., : self.d]
        x = x + lin(torch.tanh(a), self.proj)
        h = x * self.norm2.to(x.dtype)
        return x + lin(torch.tanh(lin(h, self.fc1)), self.fc2)


def build_model(layers: int, d: int, weights: str) -> nn.Sequential:
    """``weights``: fp32, bf16 (matrices and norms bf16) or fp8 (matrices E4M3, norms bf16)."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[Block(d, gen) for _ in range(layers)])
    if weights == "fp32":
        return model
    for blk in model:
        for name in ("qkv", "proj", "fc1", "fc2"):
            value = getattr(blk, name).detach()
            if weights == "fp8":
                p = nn.Parameter(Float8Tensor.quantize(value))
                p.set_high_precision_init_val(value)
            else:
                p = nn.Parameter(value.to(torch.bfloat16))
            setattr(blk, name, p)
        blk.norm1 = nn.Parameter(blk.norm1.detach().to(torch.bfloat16))
        blk.norm2 = nn.Parameter(blk.norm2.detach().to(torch.bfloat16))
    return model


# ============================================================================ CPU, several ranks
def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * (1 if isinstance(t, Float8Tensor) else t.element_size())


def run_cpu_variant(variant: str, layers: int, d: int, warmup: int, reps: int) -> dict[str, Any]:
    """Runs on every rank of the pool; returns timings, bytes per step and memory per parameter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    weights = {"dfa fp8": "fp8", "dfa bf16": "bf16"}.get(variant, "fp32")
    model = build_model(layers, d, weights)
    n_params = sum(p.numel() for p in model.parameters())
    comm: dict[str, int] = {}
    if variant.startswith("dfa"):
        opt = DistributedFusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01, bucket_cap_mb=1.0)
        fwd: nn.Module = model
    else:
        fwd = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1.0, gradient_as_bucket_view=True)

        # No annotations: DDP checks them, and `from __future__ import annotations` makes strings.
        def count_hook(state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            comm["all_reduce.grads"] = comm.get("all_reduce.grads", 0) + buf.numel() * buf.element_size()
            return dist.all_reduce(buf.div_(world), async_op=True).get_future().then(lambda f: f.value()[0])

        fwd.register_comm_hook(None, count_hook)
        if variant == "zero adamw":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8 * d // 32, 32, d, generator=gen)
    iter_times, step_times = [], []
    for it in range(warmup + reps):
        comm.clear()
        t0 = time.perf_counter()
        fwd(x).float().square().mean().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=variant.startswith("dfa"))
        if it >= warmup:
            iter_times.append(t2 - t0)
            step_times.append(t2 - t1)
    if variant.startswith("dfa"):
        comm = opt.comm_report()
        mem = opt.memory_report()
        mem = {"weights": mem["fp8_weights"] + mem["other_weights"], "grads": mem["grad_buffers"],
               "master": mem["master"], "optimizer_states": mem["optimizer_states"],
               "padding": mem["padding"]}
    else:
        if variant == "zero adamw":
            comm["broadcast.params"] = sum(_tensor_bytes(p) for p in model.parameters())
        states = opt.optim.state if variant == "zero adamw" else opt.state
        # DDP's gradient buckets (param.grad are views of them with gradient_as_bucket_view).
        mem = {"weights": sum(_tensor_bytes(p) for p in model.parameters()),
               "grads": 4 * n_params, "master": 0,
               "optimizer_states": sum(_tensor_bytes(v) for s in states.values() for v in s.values()
                                       if torch.is_tensor(v) and v.dim() > 0), "padding": 0}
    return {"variant": variant, "world_size": world, "params": n_params,
            "iter_s": statistics.median(iter_times), "step_s": statistics.median(step_times),
            "comm_bytes_per_step": comm, "comm_bytes_per_param": sum(comm.values()) / n_params,
            "ring_bytes_per_param": ring_bytes(comm, world) / n_params,
            "memory_bytes": mem, "memory_bytes_per_param": sum(mem.values()) / n_params}


def ring_bytes(comm: dict[str, int], world: int) -> float:
    """Bytes each rank sends with ring algorithms: (N-1)/N of a reduce-scatter, all-gather or
    broadcast buffer, twice that for an all-reduce (a reduce-scatter then an all-gather)."""
    f = (world - 1) / world
    return sum(v * f * (2 if k.startswith("all_reduce") else 1) for k, v in comm.items())


def cpu_main(args: argparse.Namespace) -> dict[str, Any]:
    from fp8shard.testing import DistPool

    rows = []
    with DistPool(args.world_size, backend="gloo") as pool:
        for v in CPU_VARIANTS:
            rows.append(pool.run(run_cpu_variant, v, args.layers, args.dim, args.warmup, args.reps)[0])
    print(f"\nCPU gloo, {args.world_size} ranks, {args.layers} layers x dim {args.dim} "
          f"({rows[0]['params'] / 1e6:.2f}M params), median of {args.reps}")
    print(f"{'variant':<12} {'iter s':>8} {'step s':>8} {'buffer B/param':>15} {'ring B/param':>13} "
          f"{'mem B/param':>12}  bytes per step (buffer sizes)")
    for r in rows:
        kinds = ", ".join(f"{k} {v / 1e6:.2f}MB" for k, v in sorted(r["comm_bytes_per_step"].items())
                          if v >= 1e4)
        print(f"{r['variant']:<12} {r['iter_s']:8.4f} {r['step_s']:8.4f} {r['comm_bytes_per_param']:15.2f} "
              f"{r['ring_bytes_per_param']:13.2f} {r['memory_bytes_per_param']:12.2f}  {kinds}")
    return {"mode": "cpu", "rows": rows}


# ============================================================================ GPU, one device
def _cuda_time(fn: Callable[[], None], warmup: int, reps: int) -> float:
    return median_seconds(fn, "cuda", warmup, reps)


def _gpu_params(n: int, weights: str) -> list[nn.Parameter]:
    """``n`` elements in 4096-wide matrices (the last one shorter)."""
    dev = torch.device("cuda")
    out, left = [], n
    while left > 0:
        rows = min(4096, max(1, left // 4096))
        w = torch.randn(rows, 4096, device=dev) * 0.02
        if weights == "fp8":
            out.append(nn.Parameter(Float8Tensor.quantize(w)))
        else:
            out.append(nn.Parameter(w.to(torch.bfloat16 if weights == "bf16" else torch.float32)))
        left -= rows * 4096
    return out


def profile_step(step: Callable[[], None], top: int = 8) -> dict[str, Any]:
    """One ``step()`` under torch.profiler: wall time, GPU busy time, launches, host syncs and
    the ``top`` kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels, syncs = [], 0
    for evt in prof.key_averages():
        if evt.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            syncs += evt.count
        gpu_us = getattr(evt, "device_time_total", 0.0)
        if "#" in evt.key or evt.key.startswith(("Optimizer.", "ProfilerStep")):
            continue  # record_function ranges, shown on the GPU timeline too: not kernels
        if gpu_us > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append({"name": evt.key[:70], "launches": evt.count, "gpu_ms": gpu_us / 1e3})
    kernels.sort(key=lambda k: -k["gpu_ms"])
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": sum(k["gpu_ms"] for k in kernels),
            "launches": sum(k["launches"] for k in kernels), "host_syncs": syncs - 1,  # less ours
            "kernels": kernels[:top]}


def _fake_backward(params: list[nn.Parameter]) -> None:
    """Gradients through autograd (so DistributedFusedAdam's hooks fire), cheaply."""
    # p.float() keeps a Float8Tensor (autograd sees it); .sum() then runs on the dequantized value.
    loss = sum(p.float().sum() for p in params) * 1e-3
    loss.backward()


# (row, weights, bytes per param, DistributedFusedAdam's fused step (None: AdamW), FP8 weight scaling)
GPU_VARIANTS = [
    ("dfa fp8", "fp8", 27, False, "current"),
    ("dfa fp8 triton", "fp8", 27, True, "current"),
    ("dfa fp8 triton delayed", "fp8", 27, True, "delayed"),
    ("dfa bf16", "bf16", 28, False, "current"),
    ("dfa bf16 triton", "bf16", 28, True, "current"),
    ("adamw fused fp32", "fp32", 28, None, None),
]


def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA")
    n = int(args.params_m * 1e6)
    rows = []
    for name, weights, bytes_per_param, fused_step, scaling in GPU_VARIANTS:
        params = _gpu_params(n, weights)
        count = sum(p.numel() for p in params)
        if fused_step is not None:
            opt: torch.optim.Optimizer = DistributedFusedAdam(params, lr=1e-4, weight_decay=0.01,
                                                              fp8_weight_scaling=scaling, fused=fused_step)
        else:
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        times = []
        for it in range(args.warmup + args.reps):
            _fake_backward(params)  # untimed: fills DFA's gradient buffers / param.grad
            torch.cuda.synchronize()
            t = _cuda_time(opt.step, 0, 1)
            opt.zero_grad(set_to_none=True)
            if it >= args.warmup:
                times.append(t)
        if args.profile:
            _fake_backward(params)
            prof = profile_step(opt.step)
            opt.zero_grad(set_to_none=True)
            print(f"\n{name}: one step under the profiler: {prof['wall_ms']:.2f} ms wall, "
                  f"{prof['gpu_busy_ms']:.2f} ms of kernels in {prof['launches']} launches, "
                  f"{prof['host_syncs']} host syncs")
            for k in prof["kernels"]:
                print(f"  {k['gpu_ms']:8.3f} ms {k['launches']:5d}x  {k['name']}")
        fused = getattr(opt, "_fused", None) is not None
        if fused_step and not fused:
            print(f"note: {name}: the Triton path did not run (is triton installed?)")
        sec = statistics.median(times)
        rows.append({"variant": name, "params": count, "step_s": sec, "bytes_per_param": bytes_per_param,
                     "effective_TBps": bytes_per_param * count / sec / 1e12,
                     "peak_mem_GB": torch.cuda.max_memory_allocated() / 1e9,
                     "triton": bool(fused_step) and fused, "fp8_weight_scaling": scaling,
                     "profile": prof if args.profile else None})
        del opt, params
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    adamw = next(r for r in rows if r["variant"] == "adamw fused fp32")
    for r in rows:
        r["x_adamw_fused"] = (adamw["step_s"] / adamw["params"]) / (r["step_s"] / r["params"])
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    sec = _cuda_time(lambda: dst.copy_(src), args.warmup, args.reps)
    rows.append({"variant": "copy ceiling", "params": n, "step_s": sec, "bytes_per_param": 8,
                 "effective_TBps": 8 * n / sec / 1e12, "peak_mem_GB": None})
    print(f"\n{torch.cuda.get_device_name()}, {n / 1e6:.0f}M params, median of {args.reps}")
    print(f"{'variant':<24} {'step ms':>9} {'B/param':>8} {'TB/s':>7} {'x AdamW':>8}")
    for r in rows:
        rel = f"{r['x_adamw_fused']:8.2f}" if "x_adamw_fused" in r else f"{'':>8}"
        print(f"{r['variant']:<24} {r['step_s'] * 1e3:9.3f} {r['bytes_per_param']:8d} "
              f"{r['effective_TBps']:7.2f} {rel}")
    return {"mode": "gpu", "device": torch.cuda.get_device_name(), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="one CUDA device: optimizer step bandwidth")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--params-m", type=float, default=256.0, help="GPU mode: millions of parameters")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="GPU mode: also profile one step of each variant (kernels, launches, host syncs)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    result = gpu_main(args) if args.gpu else cpu_main(args)
    result.update(torch=torch.__version__, python=platform.python_version(), args=vars(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Where the fused optimizer step's time goes on a GPU ([Note: fused step]), kernel by kernel.

    python benchmarks/bench_fused_step.py [--params-m 256] [--sweep] [--out FILE.json]

One FP8 region of --params-m million parameters in 4096-wide matrices, bf16 grads, world size 1:
kernel 1 (current scaling: Adam + amax; delayed: + the FP8 cast), kernel 2 (the cast), the
reduction of the tile amaxes, the bf16 grad-norm pass, the whole ``step()`` fused and on the
PyTorch path (``DistributedFusedAdam(fused=False)``), ``torch.optim.AdamW(fused=True)`` and a
copy. Prints one table row per timing (GB/s by the bytes each moves, and the 27-B/param
"effective" TB/s of bench_optim.py) and writes them as JSON. ``--sweep`` also times kernel 1 over
tile sizes and warps. The kernels' correctness is tested, not checked here: tests/optim/
test_fused_step.py (``pytest -m gpu``; the same checks under Triton's interpreter on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from fp8shard._triton import use_triton
from fp8shard.fp8 import Float8Tensor, Fp8Format
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim import fused_step as fs
from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.layout import ParamSpec, build_layout
from timing import median_seconds

RESULTS: dict[str, Any] = {"timings": []}


# ============================================================================ timings
def _row(name: str, sec: float, n: int, moved: float) -> None:
    row = {"what": name, "ms": sec * 1e3, "params": n, "bytes_per_param": moved,
           "GBps": moved * n / sec / 1e9, "effective_TBps_27B": 27 * n / sec / 1e12}
    RESULTS["timings"].append(row)
    print(f"| {name:<46} | {sec * 1e3:8.3f} | {moved:5.1f} | {row['GBps']:7.0f} | "
          f"{row['effective_TBps_27B']:5.2f} |", flush=True)


def timings(n_target: int, warmup: int, reps: int, sweep: bool) -> None:
    rows = max(1, n_target // 4096)
    sizes = [4096 * min(4096, rows - r) for r in range(0, rows, 4096)]
    n = sum(sizes)
    print(f"{n / 1e6:.1f}M params ({len(sizes)} matrices), bf16 grads, median of {reps}\n")
    print(f"| {'what':<46} | {'ms':>8} | {'B/p':>5} | {'GB/s':>7} | TB/s at 27 B/p |")
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 7}|{'-' * 9}|-------|")
    _kernel_timings(sizes, warmup, reps, sweep)
    torch.cuda.empty_cache()
    _step_timings(sizes, warmup, reps)


def _kernel_timings(sizes: list[int], warmup: int, reps: int, sweep: bool) -> None:
    from fp8shard.optim import triton_adam

    n = sum(sizes)
    bucket = int(25 * 2**20 / 2)
    (lay,) = build_layout([ParamSpec(i, k, torch.float8_e4m3fn) for i, k in enumerate(sizes)], 1, bucket, 16)
    rb = RegionBuffers(lay, 0, torch.device("cuda"), torch.bfloat16, torch.float32)
    rb.master.normal_(0, 0.02)
    rb.grad_buffer.normal_(0, 1e-3)
    table = fs.build_tile_table(rb.pieces, dict.fromkeys(range(len(sizes)), 0),
                                {i: i for i in range(len(sizes))}, device="cuda")
    partial = torch.zeros(table.num_tiles, device="cuda")
    scale = torch.full((len(sizes),), 448 / 0.1, device="cuda")
    hp = [fs.AdamScalars(10, 1e-4, 0.9, 0.999, 1e-8, 0.01, True)]

    def k1(mode: int) -> None:
        fs.adam_tiles_(rb, table, hp, out_mode=mode, scale=scale, partial_amax=partial)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        return median_seconds(fn, "cuda", warmup, reps)

    _row("kernel 1: Adam + amax (current)", timed(lambda: k1(fs.OUT_AMAX)), n, 26)
    _row("kernel 1: Adam + amax + cast (delayed)", timed(lambda: k1(fs.OUT_AMAX_CAST)), n, 27)
    _row("kernel 2: cast", timed(lambda: fs.cast_tiles_(rb, table, scale)), n, 5)
    _row("amax scatter over tiles",
         median_seconds(lambda: fs.slot_amax([table], [partial], len(sizes), rb.master.device),
                        "cuda", warmup, reps), n, 0)
    shards = [rb.shard(rb.grad_buffer, b.index) for b in lay.buckets]
    norm = lambda: torch._foreach_norm(shards, 2, dtype=torch.float32)
    _row("grad norm (bf16, foreach)", timed(norm), n, 2)
    if sweep:
        for block in (1024, 2048, 4096, 8192):
            t = fs.build_tile_table(rb.pieces, dict.fromkeys(range(len(sizes)), 0),
                                    {i: i for i in range(len(sizes))}, block, device="cuda")
            part = torch.zeros(t.num_tiles, device="cuda")
            for warps in (4, 8, 16):
                def run(t=t, part=part, warps=warps) -> None:  # type: ignore[no-untyped-def]
                    triton_adam.launch_adam(rb.master, rb.exp_avg, rb.exp_avg_sq, rb.grad_buffer,
                                            rb.param_buffer, t, 0, t.num_tiles, hp[0],
                                            out_mode=fs.OUT_AMAX_CAST, fmt=Fp8Format.E4M3, grad_scale=None,
                                            scale=scale, partial_amax=part, num_warps=warps)
                _row(f"  sweep kernel 1 delayed block {block} warps {warps}", timed(run), n, 27)


def _step_timings(sizes: list[int], warmup: int, reps: int) -> None:
    n = sum(sizes)
    for name, fused, scaling in (("step() fp8, PyTorch path (fused=False)", False, "current"),
                                 ("step() fp8 fused, current scaling", True, "current"),
                                 ("step() fp8 fused, delayed scaling", True, "delayed")):
        params = [torch.nn.Parameter(Float8Tensor.quantize(torch.randn(k // 4096, 4096, device="cuda") / 50))
                  for k in sizes]
        opt = DistributedFusedAdam(params, lr=1e-4, weight_decay=0.01, fp8_weight_scaling=scaling,
                                   fused=fused)
        times = []
        for it in range(warmup + reps):
            sum(p.float().sum() for p in params).backward()  # untimed: fills the gradient buckets
            torch.cuda.synchronize()
            t = median_seconds(opt.step, "cuda", 0, 1)
            opt.zero_grad()
            if it >= warmup:
                times.append(t)
        if fused and opt._fused is None:
            raise RuntimeError(f"{name}: the fused step did not run (is triton installed?)")
        _row(name, statistics.median(times), n, 27)
        del opt, params
        torch.cuda.empty_cache()
    params = [torch.nn.Parameter(torch.randn(k // 4096, 4096, device="cuda") * 0.02) for k in sizes]
    ref = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    _row("torch.optim.AdamW(fused=True), fp32", median_seconds(ref.step, "cuda", warmup, reps), n, 28)
    del ref, params
    torch.cuda.empty_cache()
    src = torch.empty(n, device="cuda")
    dst = torch.empty_like(src)
    _row("copy fp32", median_seconds(lambda: dst.copy_(src), "cuda", warmup, reps), n, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=float, default=256.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="time kernel 1 over tile sizes and warps")
    ap.add_argument("--out", default=None, help="write the timings as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not use_triton(torch.zeros(1, device="cuda")):
        raise SystemExit("needs CUDA and triton (and fp8shard.get_triton() on)")
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    timings(int(args.params_m * 1e6), args.warmup, args.reps, args.sweep)
    RESULTS.update(benchmark="fused_step", device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, args=vars(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

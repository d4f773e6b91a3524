"""Where the Triton FP8 casts' time goes on a GPU: GPU time against eager time, host time per
call, and the kernels' block and tile configurations ([Note: fused cast] in fp8shard/fp8/fused.py).

    python benchmarks/profile_cast.py [--quick] [--sweep] [--profile] [--out FILE.json]

Times the reference and the Triton paths (E4M3; bf16, and fp32 without --quick) back to back
("eager") and as CUDA-graph replays (GPU time alone), with bytes counted as in bench_quantize.py
(read x once, write one byte, once more for the transposed bytes); ``--profile`` adds the host
time per call on a small tensor and a cProfile of it; ``--sweep`` times other block sizes, tiles
and warps. Prints a table per shape and writes every row as JSON. The casts' bit-exactness is
tested, not checked here: tests/fp8/test_fused_cast.py (``pytest -m gpu``, and under Triton's
interpreter on the CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from fp8shard._triton import use_triton
from fp8shard.fp8 import fused, triton_cast
from fp8shard.fp8.formats import Fp8Format
from timing import cuda_graph  # benchmarks/timing.py (this script's folder is on sys.path)

RESULTS: dict[str, Any] = {"benchmark": "cast", "rows": [], "host_us": {}, "sweep": []}


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def make_nan_input(shape, seed):
    """bf16 randn with about 1% NaN of both signs (the sweep's check of the NaN fix-up)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g)
    f = x.view(-1)
    idx = torch.randint(0, f.numel(), (max(1, f.numel() // 97),), device="cuda", generator=g)
    sign = torch.where(torch.rand(idx.shape, device="cuda", generator=g) < 0.5, -1.0, 1.0)
    f[idx] = sign * math.nan
    return x.to(torch.bfloat16)


def launch(x, fmt, transpose):
    """The Triton current-scaling cast, launched directly (the sweep's own configuration)."""
    data = torch.full(x.shape, 0xAB, dtype=torch.uint8, device="cuda")
    data_t = (torch.full((x.shape[1], x.shape[0]), 0xAB, dtype=torch.uint8, device="cuda")
              if transpose else None)
    scale_inv = torch.full((), math.nan, device="cuda")
    amax = torch.full((), -7.0, device="cuda")
    triton_cast.launch_cast(x, fmt, data, data_t, scale_inv, amax=amax)
    v = fmt.torch_dtype
    return fused.Fp8Cast(data.view(v), None if data_t is None else data_t.view(v), scale_inv, amax)


def _median_seconds(fn, reps: int, nbuf: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / nbuf)
    return sorted(times)[len(times) // 2]


def _rows(xs, fmt, triton_only=False):
    n = xs[0].numel()
    es = xs[0].element_size()
    scale = torch.tensor(0.5, device="cuda")
    running = torch.zeros((), device="cuda")
    dst = [torch.empty_like(x) for x in xs]
    rows = {
        "copy (ceiling)": (lambda: [d.copy_(x) for d, x in zip(dst, xs, strict=True)], 2 * es * n),
        "current reference": (lambda: [fused.reference_quantize_current(x, fmt) for x in xs], (es + 1) * n),
        "current triton": (lambda: [fused.quantize_current(x, fmt) for x in xs], (es + 1) * n),
        "delayed reference": (lambda: [fused.reference_quantize_with_scale(x, scale, fmt, amax_out=running)
                                       for x in xs], (es + 1) * n),
        "delayed triton": (lambda: [fused.quantize_with_scale(x, scale, fmt, amax_out=running) for x in xs],
                           (es + 1) * n),
        "current+T reference": (lambda: [fused.reference_quantize_current(x, fmt, transpose=True)
                                         for x in xs], (es + 2) * n),
        "current+T triton": (lambda: [fused.quantize_current(x, fmt, transpose=True) for x in xs],
                             (es + 2) * n),
        "amax pass only": (lambda: [_amax_only(x) for x in xs], es * n),
    }
    if triton_only:
        rows = {k: v for k, v in rows.items() if "triton" in k or "amax" in k}
    return rows


def _graph_seconds(fn, reps: int, nbuf: int) -> float:
    """GPU time alone: ``fn`` captured in a CUDA graph, replays timed with events."""
    return _median_seconds(cuda_graph(fn).replay, reps, nbuf)


def bench(shape, reps: int, dtype=torch.bfloat16) -> None:
    fmt = Fp8Format.E4M3
    nbuf = 3
    xs = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(nbuf)]
    print(f"\ntimings, {shape[0]}x{shape[1]} {str(dtype)[6:]} -> E4M3, median of {reps} (x{nbuf} buffers); "
          "GB/s counts read x once + write FP8 once (+ once more for +T)")
    print(f"{'op':<22}{'us':>10}{'GB/s':>10}{'graph us':>10}{'GB/s':>10}   (graph: replay, GPU time only)")
    for name, (fn, nbytes) in _rows(xs, fmt).items():
        t = _median_seconds(fn, reps, nbuf)
        tg, graph_ok = 0.0, False
        try:
            tg = _graph_seconds(fn, reps, nbuf)
            graph, graph_ok = f"{tg * 1e6:>10.1f}{nbytes / tg / 1e9:>10.1f}", True
        except Exception as e:  # report and go on
            graph = f"   graph capture failed: {type(e).__name__}: {e}"[:120]
        print(f"{name:<22}{t * 1e6:>10.1f}{nbytes / t / 1e9:>10.1f}{graph}", flush=True)
        RESULTS["rows"].append({"shape": list(shape), "dtype": str(dtype)[6:], "op": name,
                                "eager_us": t * 1e6, "graph_us": tg * 1e6 if graph_ok else None,
                                "bytes": nbytes})


def profile_host(n: int = 300) -> None:
    """Host (CPU) time per call on a small tensor, and where it goes (cProfile)."""
    import cProfile
    import pstats

    fmt = Fp8Format.E4M3
    x = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.5, device="cuda")
    running = torch.zeros((), device="cuda")
    calls = {
        "current": lambda: fused.quantize_current(x, fmt),
        "delayed": lambda: fused.quantize_with_scale(x, scale, fmt, amax_out=running),
        "current+T": lambda: fused.quantize_current(x, fmt, transpose=True),
        "reference current": lambda: fused.reference_quantize_current(x, fmt),
        "amax kernel alone": lambda: _amax_only(x),
        "torch.empty": lambda: torch.empty(512, 512, device="cuda", dtype=torch.uint8),
    }
    print("\nhost time per call, 512x512 bf16 (no sync inside the loop)")
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{name:<22}{(t1 - t0) / n * 1e6:>8.1f} us", flush=True)
        RESULTS["host_us"][name] = (t1 - t0) / n * 1e6
    for name in ("delayed", "current"):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            calls[name]()
        pr.disable()
        torch.cuda.synchronize()
        print(f"\ncProfile of {n} x {name}, by own time")
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)


def sweep(shape, reps: int) -> None:
    """Time the Triton rows under other block sizes / tiles / warps (module globals)."""
    fmt = Fp8Format.E4M3
    nbuf = 3
    xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(nbuf)]
    names = ("AMAX_BLOCK", "AMAX_WARPS", "CAST_BLOCK", "CAST_WARPS", "TILE_M", "TILE_K", "TILE_WARPS",
             "_NAN_FIX")
    saved = {k: getattr(triton_cast, k) for k in names}
    configs = [dict(zip(names, c, strict=True)) for c in [
        (4096, 4, 4096, 4, 64, 64, 4, True),
        (4096, 4, 4096, 4, 64, 64, 4, False),
        (8192, 8, 8192, 8, 128, 64, 8, True),
        (2048, 4, 2048, 4, 64, 64, 8, True),
        (4096, 8, 4096, 8, 64, 128, 4, True),
        (16384, 8, 16384, 8, 32, 128, 4, True),
    ]]
    print(f"\nsweep, {shape[0]}x{shape[1]} bf16 -> E4M3 (GB/s of CUDA-graph replays)")
    for cfg in configs:
        for k, v in cfg.items():
            setattr(triton_cast, k, v)
        triton_cast._plans.clear()
        res = []
        for name, (fn, nbytes) in _rows(xs, fmt, triton_only=True).items():
            t = _graph_seconds(fn, reps, nbuf)
            res.append(f"{name.replace(' triton', '')} {nbytes / t / 1e9:7.1f}")
        if not cfg["_NAN_FIX"]:
            xn = make_nan_input((1031, 4096), 5)
            exact = all(same(launch(xn, f, True).data, fused.reference_quantize_current(xn, f).data)
                        for f in (Fp8Format.E4M3, Fp8Format.E5M2))
            res.append(f"bit-exact on NaN inputs without the fix-up: {exact}")
        print(" ".join(f"{k}={v}" for k, v in cfg.items()), "|", " | ".join(res), flush=True)
        RESULTS["sweep"].append({"config": cfg, "results": res})
    for k, v in saved.items():
        setattr(triton_cast, k, v)
    triton_cast._plans.clear()


def _amax_only(x):
    """Pass 1 alone, with the grid a current-scaling cast of x uses."""
    key = (x.shape, x.dtype, x.device, Fp8Format.E4M3, True, False, False, False)
    while key not in triton_cast._plans or not triton_cast._plans[key].fitted:
        fused.quantize_current(x, Fp8Format.E4M3)
    plan = triton_cast._plans[key]
    part = torch.empty(plan.n_part, dtype=torch.int32, device=x.device)
    triton_cast._amax_kernel[plan.amax_grid](x, part, *plan.amax_ints, **plan.amax_kw)
    return part


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape, fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="also time other block sizes and tiles")
    ap.add_argument("--profile", action="store_true", help="host time per call and a cProfile")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not use_triton(torch.empty(1, device="cuda")):
        raise SystemExit("needs CUDA and triton (and fp8shard.get_triton() on)")
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    if args.profile:
        profile_host()
    reps = 20 if args.quick else 50
    bench((14336, 4096), reps)
    if not args.quick:
        bench((14336, 4096), reps, torch.float32)
        bench((8192, 4096), reps)
    if args.sweep:
        sweep((14336, 4096), reps)
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   args=vars(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Smoke test of the Triton FP8 casts on a GPU: bit-exactness against the reference, then speed.

    PYTHONPATH=src python benchmarks/smoke_triton_cast.py [--quick] [--sweep] [--no-check]

Prints one PASS/FAIL line per check and exits 1 if any failed. Each check draws fresh inputs
(random, wide-range, NaN of both signs, inf, all zeros), fills the Triton outputs with a
sentinel first (so unwritten elements show), and compares FP8 bytes, transposed bytes,
scale_inv and amax with the eager reference path bit for bit. Then timings of
reference vs Triton (E4M3, bf16) with bytes counted as in bench_quantize.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from fp8shard._triton import use_triton
from fp8shard.fp8 import fused, triton_cast
from fp8shard.fp8.formats import Fp8Format
from timing import cuda_graph  # benchmarks/timing.py (this script's folder is on sys.path)

FAILS: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{'  ' + detail if detail and not ok else ''}", flush=True)
    if not ok:
        FAILS.append(name)


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def first_diff(a, b) -> str:
    if a is None or b is None or a.shape != b.shape:
        return f"shapes {None if a is None else tuple(a.shape)} vs {None if b is None else tuple(b.shape)}"
    au, bu = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    bad = (au != bu).nonzero()
    if len(bad) == 0:
        return ""
    i = bad[0].item()
    return f"{len(bad)} bytes differ, first at flat {i}: got {au[i].item():#04x} want {bu[i].item():#04x}"


def make(shape, dtype, kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g)
    f = x.view(-1)
    if kind == "wide":
        f *= torch.exp2(torch.randint(-20, 12, f.shape, device="cuda", generator=g).float())
    elif kind in ("nan", "inf"):
        idx = torch.randint(0, f.numel(), (max(1, f.numel() // 97),), device="cuda", generator=g)
        sign = torch.where(torch.rand(idx.shape, device="cuda", generator=g) < 0.5, -1.0, 1.0)
        f[idx] = sign * (math.nan if kind == "nan" else math.inf)
    elif kind == "zeros":
        x.zero_()
    return x.to(dtype)


def launch(x, fmt, transpose, *, scale=None, amax_out=None, poison=0xAB):
    data = torch.full(x.shape, poison, dtype=torch.uint8, device="cuda")
    data_t = (torch.full((x.shape[1], x.shape[0]), poison, dtype=torch.uint8, device="cuda")
              if transpose else None)
    scale_inv = torch.full((), math.nan, device="cuda")
    amax = torch.full((), -7.0, device="cuda") if scale is None else None
    triton_cast.launch_cast(x, fmt, data, data_t, scale_inv, scale=scale, amax=amax, amax_out=amax_out)
    v = fmt.torch_dtype
    return fused.Fp8Cast(data.view(v), None if data_t is None else data_t.view(v), scale_inv,
                         amax if scale is None else amax_out)


def compare(name, got, ref):
    ok = (same(got.data, ref.data) and same(got.data_t, ref.data_t)
          and same(got.scale_inv, ref.scale_inv) and same(got.amax, ref.amax))
    detail = (f"data: {first_diff(got.data, ref.data)}; data_t: "
              f"{first_diff(got.data_t, ref.data_t) if ref.data_t is not None else '-'}; "
              f"scale_inv {got.scale_inv.item()!r} vs {ref.scale_inv.item()!r}; "
              f"amax {None if got.amax is None else got.amax.item()!r} vs "
              f"{None if ref.amax is None else ref.amax.item()!r}") if not ok else ""
    check(name, ok, detail)


def correctness(quick: bool) -> None:
    shapes = [(7, 13), (1031, 4096), (3, 8195)] if quick else [
        (1, 1), (7, 13), (3, 8195), (1031, 4096), (4096, 1031), (2048, 2048), (8191, 129)]
    seed = 0
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for fmt in (Fp8Format.E4M3, Fp8Format.E5M2):
                for kind in ("randn", "wide", "nan", "inf", "zeros"):
                    seed += 1
                    x = make(shape, dtype, kind, seed)
                    tag = f"{'x'.join(map(str, shape))} {str(dtype)[6:]} {fmt.name} {kind}"
                    for transpose in (False, True):
                        t = "+T" if transpose else ""
                        compare(f"current{t} {tag}", launch(x, fmt, transpose),
                                fused.reference_quantize_current(x, fmt, transpose=transpose))
                        scale = torch.tensor(0.37 if kind != "wide" else 1e-3, device="cuda")
                        a_got, a_ref = torch.tensor(0.5, device="cuda"), torch.tensor(0.5, device="cuda")
                        compare(f"delayed{t} {tag}", launch(x, fmt, transpose, scale=scale, amax_out=a_got),
                                fused.reference_quantize_with_scale(x, scale, fmt, transpose=transpose,
                                                                    amax_out=a_ref))
    n0 = fused.triton_calls["quantize_current"]
    fused.quantize_current(make((64, 64), torch.bfloat16, "randn", 99), Fp8Format.E4M3)
    check("dispatch takes the Triton path", fused.triton_calls["quantize_current"] == n0 + 1)


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
        try:
            tg = _graph_seconds(fn, reps, nbuf)
            graph = f"{tg * 1e6:>10.1f}{nbytes / tg / 1e9:>10.1f}"
        except Exception as e:  # report and go on
            graph = f"   graph capture failed: {type(e).__name__}: {e}"[:120]
        print(f"{name:<22}{t * 1e6:>10.1f}{nbytes / t / 1e9:>10.1f}{graph}", flush=True)


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
            xn = make((1031, 4096), torch.bfloat16, "nan", 5)
            exact = all(same(launch(xn, f, True).data, fused.reference_quantize_current(xn, f).data)
                        for f in (Fp8Format.E4M3, Fp8Format.E5M2))
            res.append(f"bit-exact on NaN inputs without the fix-up: {exact}")
        print(" ".join(f"{k}={v}" for k, v in cfg.items()), "|", " | ".join(res), flush=True)
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
    ap.add_argument("--quick", action="store_true", help="fewer shapes, fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="also time other block sizes and tiles")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    ap.add_argument("--profile", action="store_true", help="host time per call and a cProfile")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not use_triton(torch.empty(1, device="cuda")):
        print("FAIL: needs CUDA and Triton (and FP8SHARD_TRITON unset or 1)")
        sys.exit(1)
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    t0 = time.time()
    if not args.no_check:
        correctness(args.quick)
        print(f"correctness: {len(FAILS)} failed, {time.time() - t0:.1f} s")
    if args.profile:
        profile_host()
    reps = 20 if args.quick else 50
    bench((14336, 4096), reps)
    if not args.quick:
        bench((14336, 4096), reps, torch.float32)
        bench((8192, 4096), reps)
    if args.sweep:
        sweep((14336, 4096), reps)
    if FAILS:
        print(f"\n{len(FAILS)} FAILED: " + ", ".join(FAILS[:20]))
        sys.exit(1)
    print("\nALL PASS")


if __name__ == "__main__":
    main()

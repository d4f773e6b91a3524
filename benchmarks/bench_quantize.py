"""Quantize (amax + scale + cast) and dequantize throughput against the copy bandwidth.

    python benchmarks/bench_quantize.py [--device cpu|cuda] [--quick] [--out FILE.json]

Each cast is timed on two paths in one run ([Note: fused cast] in fp8shard/fp8/fused.py):
``reference`` calls the eager reference functions directly (what ``fp8shard.set_triton(False)`` runs),
``triton`` the dispatch functions (the Triton kernels on CUDA; the rows are left out where the
Triton path does not serve, e.g. on CPU). Rows, all E4M3:

* ``current``: ``quantize_current`` (amax, scale from it, cast);
* ``delayed``: ``quantize_with_scale`` with a given scale, amax folded into a running amax;
* ``current+T``: ``quantize_current(transpose=True)``, also writing the bytes of xᵀ;
* ``Float8Tensor.quantize`` (the public entry, whichever path it takes) and ``dequantize``.

Bytes counted per element, the minimum each op must move: ``current`` and ``delayed`` read the
input once and write one FP8 byte (``es + 1``; current scaling really reads the input twice, amax
then cast, which the count leaves out), ``current+T`` writes two FP8 bytes (``es + 2``),
dequantize reads one byte and writes ``es``. The copy row is a same-size device-to-device copy
counting bytes read + written. Each timing runs over several input buffers in turn (more bytes
than L2 holds) so a call never finds its input in cache from the previous call.

On CUDA two timings per row: ``ms``/``GB/s`` of eager calls back to back (host overhead included:
a Triton call costs 60-120 us of host time on the H200 machine's CPU, more than the GPU time of
a 4096x4096 cast) and ``graph`` of the same calls captured in a CUDA graph (GPU time alone).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

import fp8shard as fs
from fp8shard._triton import use_triton
from fp8shard.fp8 import fused
from timing import cuda_graph, median_seconds

FMT = fs.Fp8Format.E4M3
L2_BYTES = 64 << 20


def _time(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn``."""
    return median_seconds(fn, device, warmup=3, reps=reps)


def _time_graph(fn, reps: int) -> float | None:
    """CUDA only: median seconds of ``fn`` captured in a CUDA graph (GPU time, no host overhead)."""
    try:
        g = cuda_graph(fn)
    except Exception:  # a case that cannot be captured gets no graph figure
        return None
    return median_seconds(g.replay, "cuda", warmup=3, reps=reps)


def _cases(xs: list[torch.Tensor]) -> dict[str, tuple]:
    """name -> (path, function over all buffers, bytes per buffer)."""
    x = xs[0]
    n, es = x.numel(), x.element_size()
    scale = torch.tensor(0.5, device=x.device)
    running = torch.zeros((), device=x.device)
    t8s = [fs.Float8Tensor.quantize(x) for x in xs]
    dsts = [torch.empty_like(x) for x in xs]
    cases = {"copy (ceiling)": ("", lambda: [d.copy_(x) for d, x in zip(dsts, xs, strict=True)], 2 * n * es)}
    paths = {"reference": (fused.reference_quantize_current, fused.reference_quantize_with_scale)}
    if use_triton(x):
        paths["triton"] = (fused.quantize_current, fused.quantize_with_scale)
    for path, (current, with_scale) in paths.items():
        cases[f"current [{path}]"] = (path, lambda c=current: [c(x, FMT) for x in xs], n * es + n)
        cases[f"delayed [{path}]"] = (
            path, lambda w=with_scale: [w(x, scale, FMT, amax_out=running) for x in xs], n * es + n)
        if x.dim() == 2:
            cases[f"current+T [{path}]"] = (
                path, lambda c=current: [c(x, FMT, transpose=True) for x in xs], n * es + 2 * n)
    cases["Float8Tensor.quantize"] = ("", lambda: [fs.Float8Tensor.quantize(x, FMT) for x in xs], n * es + n)
    cases["dequantize"] = ("", lambda: [t.dequantize() for t in t8s], n + n * es)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    dev = args.device
    shapes = [(1024, 1024), (4096, 1024)] if args.quick else [(4096, 4096), (14336, 4096)]
    reps = 5 if args.quick else 50
    rows = []
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            nbuf = 1 if dev == "cpu" else max(2, min(8, -(-3 * L2_BYTES // nbytes)))
            xs = [torch.randn(shape, dtype=dtype, device=dev) for _ in range(nbuf)]
            for name, (path, fn, nb) in _cases(xs).items():
                sec = _time(fn, dev, reps) / nbuf
                row = {"op": name, "path": path, "shape": list(shape),
                       "dtype": str(dtype).removeprefix("torch."), "buffers": nbuf,
                       "ms": sec * 1e3, "GB_per_s": nb / sec / 1e9}
                graph = _time_graph(fn, reps) if dev == "cuda" else None
                if graph is not None:
                    row["graph_ms"], row["graph_GB_per_s"] = graph / nbuf * 1e3, nb * nbuf / graph / 1e9
                rows.append(row)
            del xs
    copy_bw = {(tuple(r["shape"]), r["dtype"]): r["GB_per_s"] for r in rows if r["op"].startswith("copy")}
    name = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    print(f"device={dev} ({name}), torch {torch.__version__}")
    print(f"{'op':<24}{'shape':>12}{'dtype':>10}{'ms':>10}{'GB/s':>10}{'of copy':>9}"
          + (f"{'graph ms':>10}{'GB/s':>10}" if dev == "cuda" else ""))
    for r in rows:
        frac = r["GB_per_s"] / copy_bw[(tuple(r["shape"]), r["dtype"])]
        r["fraction_of_copy"] = frac
        graph = (f"{r['graph_ms']:>10.3f}{r['graph_GB_per_s']:>10.1f}" if "graph_ms" in r else "")
        print(f"{r['op']:<24}{'x'.join(map(str, r['shape'])):>12}{r['dtype']:>10}{r['ms']:>10.3f}"
              f"{r['GB_per_s']:>10.1f}{frac:>9.2f}{graph}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Quantize (amax + scale + cast) and dequantize throughput against the copy bandwidth.

    python benchmarks/bench_quantize.py [--device cpu|cuda] [--quick] [--out FILE.json]

Bytes counted per element: quantize reads the high-precision input twice in eager mode
(amax, then cast) but we count the minimum, one read + one FP8 write; dequantize reads one
byte and writes the high-precision value. The copy row is a same-size device-to-device copy,
counting bytes read + written.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

import fp8shard as fs
from timing import median_seconds


def _time(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn``."""
    return median_seconds(fn, device, warmup=3, reps=reps)


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
            x = torch.randn(shape, dtype=dtype, device=dev)
            n, es = x.numel(), x.element_size()
            t8 = fs.Float8Tensor.quantize(x)
            dst = torch.empty_like(x)
            cases = {
                "copy (ceiling)": (lambda x=x, dst=dst: dst.copy_(x), 2 * n * es),
                "quantize": (lambda x=x: fs.Float8Tensor.quantize(x), n * es + n),
                "dequantize": (lambda t8=t8: t8.dequantize(), n + n * es),
            }
            for name, (fn, nbytes) in cases.items():
                sec = _time(fn, dev, reps)
                rows.append({"op": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                             "ms": sec * 1e3, "GB_per_s": nbytes / sec / 1e9})
    copy_bw = {(tuple(r["shape"]), r["dtype"]): r["GB_per_s"] for r in rows if r["op"].startswith("copy")}
    name = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    print(f"device={dev} ({name}), torch {torch.__version__}")
    print(f"{'op':<16}{'shape':>14}{'dtype':>10}{'ms':>10}{'GB/s':>10}{'of copy':>9}")
    for r in rows:
        frac = r["GB_per_s"] / copy_bw[(tuple(r["shape"]), r["dtype"])]
        r["fraction_of_copy"] = frac
        print(f"{r['op']:<16}{'x'.join(map(str, r['shape'])):>14}{r['dtype']:>10}{r['ms']:>10.3f}"
              f"{r['GB_per_s']:>10.1f}{frac:>9.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

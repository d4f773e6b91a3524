"""What an FP8 cast costs inside a compiled graph, at the GPT's cast sites, by scaling and by the
form of the amax.

    python benchmarks/bench_compiled_cast.py [--tokens 16384] [--hidden 2048] [--ffn 8192]
        [--scaling current,delayed] [--amax rows,whole] [--device cuda|cpu] [--out FILE.json]

Each site is the producer of a GEMM operand and its cast, compiled together as Inductor sees
them in the whole-model graph: the GELU's output (the second FFN GEMM's input), the GELU's
backward (the gradient the first FFN GEMM's backward casts) and the LayerNorm's output (the qkv
GEMM's input), each cast with its transposed bytes (what the backward GEMMs read). ``current``
is ``fused.reference_quantize_current`` (amax, then the cast: x read twice); ``delayed`` is
``fused.reference_quantize_with_scale`` (the cast with a known scale, the amax folded into a
history slot: nothing orders the two, so Inductor may read x once). ``--amax rows`` is
``quantizer.amax`` ([Note: two-level amax]); ``whole`` is the single reduction it replaced.
Times are the median of CUDA events (``timing.median_seconds``) around the compiled call; a bf16
copy of the site's tensor is the bandwidth ceiling. Every form's bytes are checked against the
first form's of the same scaling (the same scale and bytes whatever the amax form).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from fp8shard.fp8 import fused
from fp8shard.fp8 import quantizer as q
from timing import median_seconds  # benchmarks/timing.py (this script's folder is on sys.path)

ROWS_AMAX = q.amax


def whole_amax(x: torch.Tensor) -> torch.Tensor:
    """The single whole-tensor reduction ``quantizer.amax`` used before the rows-first form."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().max().float()


def _gelu_backward(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """d gelu_tanh(h) / dh * dy, in fp32 and rounded to bf16 (what the compiled backward has)."""
    k = 0.7978845608028654
    h32 = h.float()
    t = torch.tanh(k * (h32 + 0.044715 * h32**3))
    d = 0.5 * (1 + t) + 0.5 * h32 * (1 - t * t) * k * (1 + 3 * 0.044715 * h32 * h32)
    return (d * dy.float()).to(torch.bfloat16)


def _cast(x: torch.Tensor, scaling: str, fmt: str, history: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if scaling == "current":
        c = fused.reference_quantize_current(x, fmt, transpose=True)
    else:
        c = fused.reference_quantize_with_scale(x, history[1], fmt, transpose=True, amax_out=history[0])
    assert c.data_t is not None
    return c.data, c.data_t, c.scale_inv


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (FP8 bytes compared as bytes)."""
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


SITES = {
    # name: (format, the producer of the cast tensor from the inputs)
    "gelu -> fc2 input": ("e4m3", lambda h, dy, x, w, b: F.gelu(h, approximate="tanh")),
    "gelu backward -> fc1 grad": ("e5m2", lambda h, dy, x, w, b: _gelu_backward(h, dy)),
    "layernorm -> qkv input": ("e4m3", lambda h, dy, x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)),
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(args.tokens, args.ffn, device=dev, generator=gen).to(torch.bfloat16)
    dy = torch.randn(args.tokens, args.ffn, device=dev, generator=gen).to(torch.bfloat16)
    x = torch.randn(args.tokens, args.hidden, device=dev, generator=gen).to(torch.bfloat16)
    w = torch.ones(args.hidden, device=dev, dtype=torch.bfloat16)
    b = torch.zeros(args.hidden, device=dev, dtype=torch.bfloat16)
    inputs = (h, dy, x, w, b)
    rows: list[dict[str, Any]] = []
    for site, (fmt, produce) in SITES.items():
        numel = produce(*inputs).numel()
        src, dst = h.reshape(-1)[:numel], torch.empty(numel, device=dev, dtype=torch.bfloat16)
        copy_s = median_seconds(lambda s=src, d=dst: d.copy_(s), args.device, reps=args.reps)
        for scaling in args.scaling:
            first: tuple[torch.Tensor, ...] | None = None
            for form in args.amax:
                q.amax = ROWS_AMAX if form == "rows" else whole_amax
                torch._dynamo.reset()
                history = torch.tensor([0.0, 64.0], device=dev)  # [amax slot, scale]
                fn = torch.compile(lambda *a, s=scaling, f=fmt, p=produce, hist=history:
                                   _cast(p(*a), s, f, hist))
                sec = median_seconds(lambda fn=fn: fn(*inputs), args.device, reps=args.reps)
                out = fn(*inputs)
                same = first is None or all(map(_same, out, first))
                first = first or out
                rows.append({"site": site, "scaling": scaling, "amax": form, "ms": sec * 1e3,
                             "copy_ms": copy_s * 1e3, "of_copy": copy_s / sec, "numel": numel,
                             "same_bytes": bool(same)})
                print(f"{site:28s} {scaling:8s} {form:6s} {sec * 1e3:8.3f} ms   "
                      f"copy {copy_s * 1e3:6.3f} ms   same bytes: {same}", flush=True)
    q.amax = ROWS_AMAX
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    return {"benchmark": "compiled_cast", "device": name, "torch": torch.__version__,
            "config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--scaling", type=lambda s: s.split(","), default=["current", "delayed"])
    ap.add_argument("--amax", type=lambda s: s.split(","), default=["rows", "whole"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    for s in args.scaling:
        if s not in ("current", "delayed"):
            ap.error(f"--scaling takes current and delayed, got {s!r}")
    for f in args.amax:
        if f not in ("rows", "whole"):
            ap.error(f"--amax takes rows and whole, got {f!r}")
    result = run(args)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

"""SQNR of each scaling recipe on three kinds of activations (CPU is enough: the numerics are
the same on every path, [Note: tiled GEMM paths]).

    python benchmarks/sqnr_recipes.py [--fp8-params] [--out FILE.json]

``--fp8-params``: the weight stored in FP8 with the recipe's scales (``fp8_model_init(recipe=)``:
per tensor, per row, per 128x128 block) and used as stored ([Note: tiled FP8 weights]); ``w``
is then the SQNR of the stored weight.

A ``fs.nn.Linear(1024, 512)`` (fp32 weight, N(0, 1/1024)), 512 tokens; forward and backward
under each recipe, E4M3 everywhere (``fp8_format="e4m3"``) so the recipes differ only in their
scales, and the SQNR (dB) of y, dx and dW against fp64 math on the same values; ``x cast``:
the forward's activation operand alone (dequantized vs x); ``y small``: y over the eighth of the
tokens with the smallest values. y, dx and dW also carry the weight's and gradient's rounding
(about 29 dB at E4M3), which hides part of what finer activation scales gain.

  random    x ~ N(0, 1)
  outliers  x ~ N(0, 1) with 4 channels x100 (every token)
  ranges    token t scaled by 10^(-4 + 5 t / T): tokens spanning 10^5, more than E4M3's
            normal range
"""

from __future__ import annotations

import argparse
import json

import torch

import fp8shard as fs
from fp8shard.fp8.quantizer import quantizer_for
from fp8shard.testing import sqnr_db

RECIPES = {"tensorwise": fs.CurrentScaling(fp8_format="e4m3"), "rowwise": fs.RowwiseScaling(),
           "blockwise": fs.BlockwiseScaling()}
TOKENS, IN, OUT = 512, 1024, 512


def _inputs(case: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(TOKENS, IN, generator=gen)
    if case == "outliers":
        x[:, torch.randperm(IN, generator=gen)[:4]] *= 100.0
    elif case == "ranges":
        x *= torch.logspace(-4, 1, TOKENS)[:, None]
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp8-params", action="store_true",
                    help="the weight stored in FP8 with the recipe's scales")
    args = ap.parse_args()
    rows = []
    for case in ("random", "outliers", "ranges"):
        gen = torch.Generator().manual_seed(0)
        x, dy = _inputs(case, gen), torch.randn(TOKENS, OUT, generator=gen)
        torch.manual_seed(1)
        layer = fs.nn.Linear(IN, OUT, bias=False)
        w64, x64, dy64 = layer.weight.detach().double(), x.double(), dy.double()
        for name, recipe in RECIPES.items():
            if args.fp8_params:
                with fs.fp8_model_init(recipe=None if name == "tensorwise" else recipe):
                    layer = fs.nn.Linear(IN, OUT, bias=False)
                layer.weight.quantize_(w64.float())
            xr = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            with fs.fp8_autocast(recipe=recipe):
                y = layer(xr)
            y.backward(dy)
            y64 = x64 @ w64.t()
            small = x.abs().amax(dim=1).argsort()[: TOKENS // 8]
            x_op, _ = quantizer_for(recipe).quantize(x, fs.Fp8Format.E4M3, "activation")
            rows.append({"case": case, "recipe": name, "y": sqnr_db(y64, y),
                         "dx": sqnr_db(dy64 @ w64, xr.grad), "dw": sqnr_db(dy64.t() @ x64, layer.weight.grad),
                         "x_cast": sqnr_db(x64, x_op.dequantize()), "y_small": sqnr_db(y64[small], y[small]),
                         "w": sqnr_db(w64, layer.weight.dequantize(torch.float64)) if args.fp8_params
                         else None})
    print(f"SQNR (dB) against fp64, fs.nn.Linear({IN}, {OUT}), {TOKENS} tokens, E4M3 everywhere")
    print(f"{'case':<10}{'recipe':<12}{'y':>7}{'dx':>7}{'dW':>7}{'x cast':>8}{'y small':>9}"
          + (f"{'w':>7}" if args.fp8_params else ""))
    for r in rows:
        print(f"{r['case']:<10}{r['recipe']:<12}{r['y']:>7.1f}{r['dx']:>7.1f}{r['dw']:>7.1f}"
              f"{r['x_cast']:>8.1f}{r['y_small']:>9.1f}" + (f"{r['w']:>7.1f}" if args.fp8_params else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

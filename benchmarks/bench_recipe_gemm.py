"""The recipes' GEMMs on this GPU: which path serves them, and do they match the emulation?

    python benchmarks/bench_recipe_gemm.py [--out FILE.json]

For each recipe (tensorwise, rowwise, blockwise) and each of the three GEMMs of a linear layer
([Note: three GEMMs]), bf16 output, shape 4096 tokens x 4096 -> 4096 (and a ragged one): the
path ``Quantizer.gemm`` takes, its SQNR against the emulated path (the reference: dequantize
per tile, fp32 product) and against the fp64 product of the unquantized operands, and the
median time of both paths (CUDA events). A torch._scaled_mm error is reported, not raised.
PASS: the served path is within bf16 rounding of the emulation (>= 40 dB).
"""

from __future__ import annotations

import argparse
import json

import torch

from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.quantizer import (
    BlockwiseQuantizer,
    Fp8Operand,
    RowwiseQuantizer,
    TensorwiseQuantizer,
    emulated_tiled_mm,
)
from fp8shard.testing import sqnr_db
from timing import median_seconds

E4M3 = Fp8Format.E4M3


def _operands(tokens: int, k_in: int, n_out: int, device: str) -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k_in, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(n_out, k_in, generator=gen) * 0.02).to(device, torch.bfloat16)
    dy = torch.randn(tokens, n_out, generator=gen).to(device, torch.bfloat16)
    # (a [M, K], kind of a), (b [N, K], kind of b): y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x
    return {"fwd": ((x, "activation"), (w, "weight")),
            "dgrad": ((dy, "activation"), (w.t().contiguous(), "weight")),
            "wgrad": ((dy.t().contiguous(), "activation"), (x.t().contiguous(), "activation"))}


def _ms(fn, a: Fp8Operand, b: Fp8Operand, reps: int) -> float:
    return median_seconds(lambda: fn(a, b, torch.bfloat16), "cuda", 3, reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = "cuda"
    rows = []
    for shape in ((4096, 4096, 4096), (1000, 640, 384)):
        for q in (TensorwiseQuantizer(), RowwiseQuantizer(), BlockwiseQuantizer()):
            for gemm_name, ((a_hp, a_kind), (b_hp, b_kind)) in _operands(*shape, device).items():
                a, _ = q.quantize(a_hp, E4M3, a_kind)
                b, _ = q.quantize(b_hp, E4M3, b_kind)
                ref64 = a_hp.double() @ b_hp.double().t()
                path = q.gemm_path(a, b, torch.bfloat16) if hasattr(q, "gemm_path") else "fp8_mm"
                row = {"shape": "x".join(map(str, shape)), "recipe": q.name, "gemm": gemm_name, "path": path}
                try:
                    y = q.gemm(a, b, torch.bfloat16)
                    emu = (emulated_tiled_mm(a, b, torch.float32) if a.block is not None
                           else (a.dequantize() @ b.dequantize().t()))
                    row.update(sqnr_vs_emulation=sqnr_db(emu, y), sqnr_vs_fp64=sqnr_db(ref64, y),
                               ms=_ms(q.gemm, a, b, args.reps))
                    if a.block is not None:
                        row["emulated_ms"] = _ms(emulated_tiled_mm, a, b, args.reps)
                    row["pass"] = row["sqnr_vs_emulation"] >= 40
                except Exception as e:  # report the kernel's refusal and go on
                    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", ok=False)
                rows.append(row)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':>16} {'recipe':<11}{'gemm':<7}{'path':<11}{'vs emu dB':>10}{'vs fp64 dB':>11}"
          f"{'ms':>9}{'emu ms':>9}  result")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:>16} {r['recipe']:<11}{r['gemm']:<7}{r['path']:<11}  ERROR {r['error']}")
            continue
        emu_ms = f"{r['emulated_ms']:>9.3f}" if "emulated_ms" in r else f"{'-':>9}"
        print(f"{r['shape']:>16} {r['recipe']:<11}{r['gemm']:<7}{r['path']:<11}"
              f"{r['sqnr_vs_emulation']:>10.1f}{r['sqnr_vs_fp64']:>11.1f}{r['ms']:>9.3f}{emu_ms}"
              f"  {'PASS' if r['pass'] else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()

"""Forward + backward of one linear layer: fp8shard FP8 vs bf16 ``nn.Linear`` (vs torchao).

    python benchmarks/bench_linear.py [--device cpu|cuda] [--quick] [--no-compile] [--out FILE.json]
                                      [--tokens N] [--variants "fp8 current,fp8 delayed"]
                                      [--recipe tensorwise|delayed|rowwise|blockwise ...]
                                      [--shapes 768x3072,3072x768] [--compile-only]

Shapes: 8192 tokens, 4096->14336 and 14336->4096 (an LLM FFN); ``--quick``: 128 tokens,
256->512 and 512->256 (CPU-sized); ``--tokens`` changes the token count only (the FFN's
weights at fewer tokens: its SQNR figures on a CPU); ``--shapes IN x OUT,...`` other layers (the
sweep behind the FP8 layer filter, docs/performance.md). Every variant computes in bf16 inputs and weights:
  bf16             torch.nn.Linear
  fp8 current      fp8shard.nn.Linear, bf16 weight, CurrentScaling
  fp8 delayed      fp8shard.nn.Linear, bf16 weight, DelayedScaling (AmaxSync.step() after
                   each backward, so each step also updates the amax history)
  fp8 params       fp8shard.nn.Linear built in fp8_model_init (E4M3 weight), CurrentScaling
  torchao          torchao.float8 Float8Linear, tensorwise scaling (if torchao imports)
  fp8 rowwise      fp8shard.nn.Linear, bf16 weight, RowwiseScaling (asked for only)
  fp8 blockwise    fp8shard.nn.Linear, bf16 weight, BlockwiseScaling (asked for only)
``--recipe`` runs bf16 and the fp8shard variants of the recipes named (tensorwise is "fp8 current").
each eager and under ``torch.compile``. A step is forward, backward (grads of input and
weight) and ``zero_grad``; the time is the median over repetitions (CUDA events on a GPU,
``perf_counter`` on CPU). TFLOP/s counts the three GEMMs: 6 x tokens x in x out.
``sqnr_first_db`` is the output's SQNR against the bf16 layer's output on the same values at
the first call of a fresh layer, ``sqnr_db`` at call 4 (delayed scaling: scales from the history
of calls 1-3; the first call casts as current scaling, [Note: informed first call]).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
from collections.abc import Callable
from typing import Any

import torch

import fp8shard as fs
from fp8shard.testing import sqnr_db
from timing import median_seconds

VARIANTS = ["bf16", "fp8 current", "fp8 delayed", "fp8 params", "torchao"]
EXTRA_VARIANTS = ["fp8 rowwise", "fp8 blockwise"]  # run when asked for (--variants, --recipe)
RECIPE_VARIANTS = {"tensorwise": "fp8 current", "delayed": "fp8 delayed", "rowwise": "fp8 rowwise",
                   "blockwise": "fp8 blockwise"}


def _time(step: Callable[[], None], device: str, warmup: int, reps: int) -> float:
    """Median seconds of ``step`` after ``warmup`` untimed calls (which include compilation)."""
    return median_seconds(step, device, warmup, reps)


SQNR_CALL = 4  # the later call whose output SQNR is reported (delayed: history of 3 calls)


def _build(variant: str, ref: torch.nn.Linear) -> tuple[torch.nn.Module, Callable[[], Any],
                                                         Callable[[], None]]:
    """The layer of ``variant`` with ``ref``'s values, the context its steps run in, and what
    runs after each backward (delayed scaling: the amax update, [Note: amax reduction])."""
    if variant == "bf16":
        layer = torch.nn.Linear(ref.in_features, ref.out_features, device=ref.weight.device,
                                dtype=torch.bfloat16)
        layer.load_state_dict(ref.state_dict())
        return layer, contextlib.nullcontext, _nothing
    if variant == "torchao":
        from torchao.float8 import convert_to_float8_training  # optional dependency

        model = torch.nn.Sequential(torch.nn.Linear(ref.in_features, ref.out_features,
                                                    device=ref.weight.device, dtype=torch.bfloat16))
        model[0].load_state_dict(ref.state_dict())
        return convert_to_float8_training(model), contextlib.nullcontext, _nothing
    with fs.fp8_model_init(enabled=variant == "fp8 params"):
        layer = fs.nn.Linear(ref.in_features, ref.out_features, device=ref.weight.device,
                             dtype=torch.bfloat16)
    layer.load_state_dict(ref.state_dict())  # quantizes into the FP8 weight for "fp8 params"
    if variant == "fp8 delayed":
        recipe, after_backward = fs.DelayedScaling(), fs.nn.AmaxSync(layer).step
    else:
        recipe = {"fp8 rowwise": fs.RowwiseScaling(), "fp8 blockwise": fs.BlockwiseScaling()}.get(
            variant, fs.CurrentScaling())
        after_backward = _nothing
    return layer, lambda: fs.fp8_autocast(recipe=recipe), after_backward


def _nothing() -> None:
    pass


def _measure(variant: str, compiled: bool, ref: torch.nn.Linear, x: torch.Tensor, dy: torch.Tensor,
             y_ref: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    layer, ctx, after_backward = _build(variant, ref)
    if compiled and variant == "fp8 delayed":  # its amax state made now, not inside the graph
        fs.nn.prepare_delayed_scaling(layer, fs.DelayedScaling())
    model = torch.compile(layer, dynamic=False) if compiled else layer
    x = x.detach().requires_grad_()

    def step() -> torch.Tensor:
        with ctx():
            y = model(x)
        y.backward(dy)
        after_backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return y

    y_first = step()  # a fresh layer's first call
    for _ in range(SQNR_CALL - 1):
        y = step()
    device = x.device.type
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sec = _time(step, device, args.warmup, args.reps)
    tokens, (out_f, in_f) = x.shape[0], ref.weight.shape
    row = {"variant": variant, "mode": "compile" if compiled else "eager", "tokens": tokens,
           "in": in_f, "out": out_f, "ms": sec * 1e3, "tflops": 6 * tokens * in_f * out_f / sec / 1e12,
           "sqnr_first_db": sqnr_db(y_ref, y_first), "sqnr_db": sqnr_db(y_ref, y)}
    if device == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return row


def _run_shape(tokens: int, in_f: int, out_f: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    ref = torch.nn.Linear(in_f, out_f, device=args.device, dtype=torch.bfloat16)
    x = torch.randn(tokens, in_f, device=args.device, dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_f, device=args.device, dtype=torch.bfloat16)
    with torch.no_grad():
        y_ref = ref(x).float()
    rows = []
    for compiled in args.modes:
        for variant in args.variants:
            try:
                rows.append(_measure(variant, compiled, ref, x, dy, y_ref, args))
            except Exception as e:  # e.g. torchao not installed: report it, keep going
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
                rows.append({"variant": variant, "mode": "compile" if compiled else "eager",
                             "tokens": tokens, "in": in_f, "out": out_f, "unavailable": reason})
            torch._dynamo.reset()
    return rows


def _print(rows: list[dict[str, Any]], header: str) -> None:
    print(header)
    print(f"{'shape':>20}{'mode':>9}  {'variant':<14}{'ms':>10}{'TFLOP/s':>10}{'vs bf16':>9}"
          f"{'SQNR@1':>9}{f'SQNR@{SQNR_CALL}':>9}")
    base = {(r["tokens"], r["in"], r["out"], r["mode"]): r["ms"] for r in rows if r["variant"] == "bf16"
            and "ms" in r}
    for r in rows:
        shape = f"{r['tokens']}x{r['in']}->{r['out']}"
        if "unavailable" in r:
            print(f"{shape:>20}{r['mode']:>9}  {r['variant']:<14}  unavailable ({r['unavailable']})")
            continue
        b = base.get((r["tokens"], r["in"], r["out"], r["mode"]))
        r["speedup_vs_bf16"] = b / r["ms"] if b else None
        speed = f"{r['speedup_vs_bf16']:.2f}x" if b else "-"
        print(f"{shape:>20}{r['mode']:>9}  {r['variant']:<14}{r['ms']:>10.3f}{r['tflops']:>10.2f}"
              f"{speed:>9}{r['sqnr_first_db']:>9.1f}{r['sqnr_db']:>9.1f}")


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS + EXTRA_VARIANTS]
    if unknown:
        raise SystemExit(f"bench_linear.py: unknown variant(s) {unknown}; choose from "
                         f"{', '.join(VARIANTS + EXTRA_VARIANTS)}, "
                         f"comma-separated, e.g. --variants \"fp8 current,fp8 delayed\"")
    return ["bf16"] + [v for v in names if v != "bf16"]  # the speed-up is against bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions (CPU)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager only")
    ap.add_argument("--compile-only", action="store_true", help="compiled only (no eager rows)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated IN x OUT layer shapes, e.g. 768x3072,3072x768 (with --tokens; "
                         "the FP8 layer filter's sweep, [Note: FP8 layer filter])")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 8192; --quick 128)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from: {', '.join(VARIANTS)} (bf16 is always run: the reference)")
    ap.add_argument("--recipe", nargs="+", choices=list(RECIPE_VARIANTS), default=None,
                    help="bf16 and fp8shard.nn.Linear under these recipes (instead of --variants)")
    args = ap.parse_args()
    args.variants = _variants(",".join(RECIPE_VARIANTS[r] for r in args.recipe) if args.recipe
                              else args.variants)
    shapes = [(128, 256, 512), (128, 512, 256)] if args.quick else [(8192, 4096, 14336),
                                                                        (8192, 14336, 4096)]
    if args.shapes:
        try:
            shapes = [(shapes[0][0], *(int(d) for d in s.lower().split("x"))) for s in args.shapes.split(",")]
        except ValueError:
            raise SystemExit(f"bench_linear.py: --shapes takes IN x OUT pairs such as 768x3072,3072x768, "
                             f"got {args.shapes!r}") from None
        if any(len(s) != 3 for s in shapes):
            raise SystemExit(f"bench_linear.py: each --shapes entry is IN x OUT, got {args.shapes!r}")
    if args.tokens is not None:
        shapes = [(args.tokens, i, o) for _, i, o in shapes]
    if args.compile_only and not args.compile:
        raise SystemExit("bench_linear.py: --compile-only and --no-compile leave nothing to run")
    args.modes = (True,) if args.compile_only else (False, True) if args.compile else (False,)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    args.reps = args.reps if args.reps is not None else (5 if args.quick else 30)
    rows = [r for shape in shapes for r in _run_shape(*shape, args)]
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    _print(rows, f"device={args.device} ({name}), torch {torch.__version__}, median of {args.reps}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "device_name": name, "torch": torch.__version__,
                       "quick": args.quick, "reps": args.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

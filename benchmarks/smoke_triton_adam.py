"""Smoke test and timings of the fused Triton optimizer step, for a GPU ([Note: fused step]).

    python benchmarks/smoke_triton_adam.py [--params-m 256] [--sweep] [--out FILE.json]

Prints PASS/FAIL per check, then timings. Checks (small, fresh random data):
  fp8 encoding     kernel 2 on 2M random fp32 bit patterns and every FP8 boundary: bytes == cast_to_fp8
  kernel layouts   kernel 1 (+2) against the reference on the layouts of tests/optim/test_fused_step.py:
                   bytes and amax bit-exact, nothing outside the tiles written, master/m/v within
                   ULPS ulps of adam_(fused=False) (max ulps and the bit-identical fraction printed)
  optimizer        DistributedFusedAdam (one process) 6 steps with FP8SHARD_TRITON=1 vs =0
Timings (one FP8 region of --params-m million parameters in 4096-wide matrices, bf16 grads, world
size 1): kernel 1 (current: Adam + amax; delayed: + cast), kernel 2, the bf16 grad-norm pass,
whole ``step()`` with and without Triton, torch.optim.AdamW(fused=True) and a copy; GB/s by the
bytes each moves and the 27-B/param "effective" figure of bench_optim.py. ``--sweep`` also times
kernel 1 over tile sizes and warps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.*
os.environ.setdefault("FP8SHARD_TRITON", "1")
os.environ.setdefault("FP8SHARD_FUSED_ADAM", "1")  # the optimizer's opt-in: this script checks it

from fp8shard._triton import use_triton
from fp8shard.fp8 import Float8Tensor, Fp8Format, cast_to_fp8
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim import fused_step as fs
from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.layout import ParamSpec, build_layout
from timing import median_seconds

RESULTS: dict[str, Any] = {"checks": {}, "timings": []}


def check(name: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        info = fn()
        print(f"PASS  {name}" + (f"  {info}" if info else ""), flush=True)
        RESULTS["checks"][name] = {"ok": True, "info": info}
    except Exception as e:  # report and go on
        print(f"FAIL  {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=3)
        RESULTS["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}


# ============================================================================ checks
def check_fp8_encoding() -> str:
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 21,), generator=gen, dtype=torch.int64).to(torch.int32)
    parts = [bits.view(torch.float32)]
    for fmt in Fp8Format:
        v = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float()
        v = v[torch.isfinite(v)].sort().values
        mid = (v[1:] + v[:-1]) / 2
        for t in (v, mid):
            parts += [t, torch.nextafter(t, t + 1), torch.nextafter(t, t - 1)]
    x = torch.cat(parts).cuda()
    out = []
    for fmt in Fp8Format:
        sizes = [x.numel(), 5]
        (lay,) = build_layout([ParamSpec(i, n, fmt.torch_dtype) for i, n in enumerate(sizes)], 1, 1 << 30, 16)
        rb = RegionBuffers(lay, 0, torch.device("cuda"), torch.bfloat16, torch.float32)
        rb.master[: x.numel()] = x
        table = fs.build_tile_table(rb.pieces, {0: 0, 1: 0}, {0: 0, 1: 1}, device="cuda")
        fs.cast_tiles_(rb, table, torch.tensor([1.0, 1.0], device="cuda"))
        got = rb.param_buffer[: x.numel()]
        want = cast_to_fp8(x, torch.tensor(1.0, device="cuda"), fmt).view(torch.uint8)
        nan = torch.isnan(x)
        bad = int((got[~nan] != want[~nan]).sum())
        bad_nan = int(((got[nan] & 0x7F) != 0x7F).sum())  # c10's NaN: 0x7F with the sign bit
        assert bad == 0 and bad_nan == 0, f"{fmt.name}: {bad} byte mismatches, {bad_nan} NaN not NaN"
        out.append(f"{fmt.name} {x.numel()} values")
    return ", ".join(out)


def check_kernel_layouts() -> str:
    from tests.optim.test_fused_step import LAYOUTS, check_kernels

    worst: dict[str, float] = {}
    ident: dict[str, list[float]] = {}
    n = 0
    for world, rank, sizes, bucket, align, block in LAYOUTS:
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
            for i, (grad_dtype, adam_w, mode) in enumerate([(torch.bfloat16, True, "current"),
                                                            (torch.float32, False, "delayed"),
                                                            (torch.bfloat16, False, "delayed"),
                                                            (torch.float32, True, "current")]):
                st = check_kernels(world, rank, sizes, dtype, bucket=bucket, align=align,
                                   grad_dtype=grad_dtype, state_dtype=torch.float32, adam_w=adam_w,
                                   mode=mode, block=block, clip=i % 2 == 0, seed=n)
                n += 1
                for k, v in st.items():
                    if k.endswith("max_ulps"):
                        worst[k] = max(worst.get(k, 0.0), v)
                    else:
                        ident.setdefault(k, []).append(v)
    for state in (torch.bfloat16, torch.float16):
        check_kernels(3, 2, [5000, 77, 2048], torch.float8_e4m3fn, bucket=4096, align=16,
                      grad_dtype=torch.bfloat16, state_dtype=state, adam_w=True, mode="delayed",
                      block=fs.DEFAULT_BLOCK, clip=False)
        n += 1
    RESULTS["kernel_ulps"] = worst
    RESULTS["kernel_identical"] = {k: min(v) for k, v in ident.items()}
    ulps = ", ".join(f"{k.split('.')[0]} {v:.2f}" for k, v in worst.items())
    same = ", ".join(f"{k.split('.')[0]} {min(v):.4f}" for k, v in ident.items())
    return f"{n} cases; worst ulps: {ulps}; bit-identical fraction (min): {same}"


def _train(triton: str, scaling: str) -> tuple[list[torch.nn.Parameter], DistributedFusedAdam]:
    os.environ["FP8SHARD_TRITON"] = triton
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for shape in ((300, 77), (64, 64), (2048, 16), (5000, 3)):
        w = torch.randn(*shape, generator=gen, device="cuda") * 0.05
        p = torch.nn.Parameter(Float8Tensor.quantize(w))
        p.set_high_precision_init_val(w)
        params.append(p)
    params.append(torch.nn.Parameter((torch.randn(1000, generator=gen, device="cuda")).bfloat16()))
    opt = DistributedFusedAdam([{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}],
                               lr=1e-2, weight_decay=0.1, bucket_cap_mb=20000 * 2 / 2**20,
                               fp8_weight_scaling=scaling)
    for step in range(1, 7):
        g = torch.Generator(device="cuda").manual_seed(step)
        loss = sum((p.float() * torch.randn(p.shape, generator=g, device="cuda")).sum() for p in params)
        (loss * 1e-2).backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    assert (opt._fused is not None) == (triton == "1")
    return params, opt


def check_optimizer(scaling: str) -> str:
    pa, oa = _train("1", scaling)
    pb, ob = _train("0", scaling)
    os.environ["FP8SHARD_TRITON"] = "1"
    sa, sb = oa.state_dict(), ob.state_dict()
    worst = 0.0
    for i in sa["state"]:
        x, y = sa["state"][i]["master"], sb["state"][i]["master"]
        worst = max(worst, float(((x - y).abs() / y.abs().clamp_min(1e-6)).max()))
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    codes = 0
    for p, q in zip(pa, pb, strict=True):
        if isinstance(p, Float8Tensor):
            d = (p.uint8_view().int() - q.uint8_view().int()).abs()
            assert int(d.max()) <= 1
            codes += int((d > 0).sum())
            torch.testing.assert_close(p._scale_inv, q._scale_inv, rtol=1e-6, atol=0)
    return f"max master rel diff {worst:.2e}, FP8 codes off by one: {codes}"


# ============================================================================ timings
def _row(name: str, sec: float, n: int, moved: float) -> None:
    row = {"what": name, "ms": sec * 1e3, "params": n, "bytes_per_param": moved,
           "GBps": moved * n / sec / 1e9, "effective_TBps_27B": 27 * n / sec / 1e12}
    RESULTS["timings"].append(row)
    print(f"  {name:<44} {sec * 1e3:8.3f} ms  {moved:5.1f} B/p  {row['GBps']:7.0f} GB/s  "
          f"(27 B/p: {row['effective_TBps_27B']:.2f} TB/s)", flush=True)


def timings(n_target: int, warmup: int, reps: int, sweep: bool) -> None:
    rows = max(1, n_target // 4096)
    sizes = [4096 * min(4096, rows - r) for r in range(0, rows, 4096)]
    n = sum(sizes)
    print(f"\ntimings: {n / 1e6:.1f}M params ({len(sizes)} matrices), bf16 grads, median of {reps}")
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
    for name, triton, scaling in (("step() fp8 reference (FP8SHARD_TRITON=0)", "0", "current"),
                                  ("step() fp8 triton, current scaling", "1", "current"),
                                  ("step() fp8 triton, delayed scaling", "1", "delayed")):
        os.environ["FP8SHARD_TRITON"] = triton
        params = [torch.nn.Parameter(Float8Tensor.quantize(torch.randn(k // 4096, 4096, device="cuda") / 50))
                  for k in sizes]
        opt = DistributedFusedAdam(params, lr=1e-4, weight_decay=0.01, fp8_weight_scaling=scaling)
        times = []
        for it in range(warmup + reps):
            sum(p.float().sum() for p in params).backward()  # untimed: fills the gradient buckets
            torch.cuda.synchronize()
            t = median_seconds(opt.step, "cuda", 0, 1)
            opt.zero_grad()
            if it >= warmup:
                times.append(t)
        _row(name, statistics.median(times), n, 27)
        del opt, params
        torch.cuda.empty_cache()
    os.environ["FP8SHARD_TRITON"] = "1"
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
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    def triton_on() -> None:
        if not use_triton(torch.zeros(1, device="cuda")):
            raise RuntimeError("use_triton() is False: FP8SHARD_TRITON=0, or triton does not import")

    check("use_triton", triton_on)
    if not args.skip_checks:
        check("fp8 encoding (kernel 2) == cast_to_fp8", check_fp8_encoding)
        check("kernel 1/2 vs reference on test layouts", check_kernel_layouts)
        check("optimizer FP8SHARD_TRITON=1 vs 0, current scaling", lambda: check_optimizer("current"))
        check("optimizer FP8SHARD_TRITON=1 vs 0, delayed scaling", lambda: check_optimizer("delayed"))
    timings(int(args.params_m * 1e6), args.warmup, args.reps, args.sweep)
    failed = [k for k, v in RESULTS["checks"].items() if not v["ok"]]
    print(f"\n{len(RESULTS['checks']) - len(failed)} passed, {len(failed)} failed")
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   args=vars(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=2)
        print(f"wrote {args.out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

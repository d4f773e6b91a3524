"""What one optimizer step costs the host, outside its kernels.

    python benchmarks/bench_step_host.py [--width 64] [--reps 50] [--rounds 3] [--out FILE.json]
    python benchmarks/bench_step_host.py --gpu [--reps 30] [--out FILE.json]

The parameters are those of the training command's GPT (``config=gpt_125m``'s 12 layers: 148
tensors, 48 of them FP8 weights, current scaling), built by ``fp8shard.train``'s
``build_model``; the optimizer is ``DistributedFusedAdam`` with the fused step ([Note: fused
step]), world size 1. Timed: ``clip_grad_norm`` + ``step()`` + ``zero_grad()`` after a backward,
as the training loop calls them.

CPU mode: the GPT at hidden size ``--width`` (same tensors, small ones) with the bucket and
region caps scaled by its size, so that its buffers split as the 125M model's do (11 buckets, 2
regions). The fused step's Triton kernels are replaced by a stub that counts its launches:
what is left is the step's host work, its Python and the PyTorch ops around the kernels (on
tensors this small their compute is a few microseconds). ``--recipe rowwise|blockwise``: the FP8
weights keep row or block scales, which the fused step does not serve, so the step runs the
reference kernel (PyTorch ops, on the GPU as here); its ops then compute on the CPU, so its host
ms includes that compute, and its PyTorch op count is the measure. Reported per step: host ms (median of
``--reps``, the best of ``--rounds``), Python function calls (cProfile), PyTorch ops dispatched,
kernel launches stubbed, and the functions with the most time (cProfile, cumulative).

``--gpu``: the 125M model itself on one CUDA device, the real kernels: host ms (the calls'
return) and wall ms (to the device's end), and ``torch.optim.AdamW(fused=True)`` beside it on the
same GPT as the compiled reference of compare_peers.py holds it (fp32 weights, with
``clip_grad_norm_``). Where host ms reaches wall ms, the step waits on the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import platform
import pstats
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from timing import write_json

TILED = ("rowwise", "blockwise")
SHAPE_125M = dict(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
                  encoder_seq_length=1024, micro_batch_size=8)
VOCAB_125M = 50304
PARAMS_125M = 124.4e6  # what the caps below were chosen for: 25 MiB buckets, 256 MiB regions


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _StubKernels:
    """The fused step's Triton launches replaced by a counter (CPU mode)."""

    def __init__(self) -> None:
        from fp8shard.optim import triton_adam

        self.launches = 0
        self._mod = triton_adam
        self._real = (triton_adam.launch_adam, triton_adam.launch_cast)
        triton_adam.launch_adam = self._count
        triton_adam.launch_cast = self._count

    def _count(self, *args: Any, **kwargs: Any) -> None:
        self.launches += 1

    def restore(self) -> None:
        self._mod.launch_adam, self._mod.launch_cast = self._real


def build_model(args: argparse.Namespace, fp8: bool = True) -> tuple[torch.nn.Module, Any]:
    """The command's GPT (FP8 weights unless ``fp8`` is False) and a function running one backward."""
    from fp8shard.train.builders import build_model as build
    from fp8shard.train.config import load_config

    if args.gpu:
        shape, vocab, device = SHAPE_125M, VOCAB_125M, torch.device("cuda")
    else:
        w = args.width
        shape = dict(num_layers=12, hidden_size=w, ffn_hidden_size=4 * w, num_attention_heads=2,
                     encoder_seq_length=16, micro_batch_size=1)
        vocab, device = 256, torch.device("cpu")
    ov = [f"model.{k}={v}" for k, v in shape.items()]
    ov += [f"model.fp8_recipe={args.recipe}", f"trainer.accelerator={'gpu' if args.gpu else 'cpu'}"]
    if not fp8:
        ov += ["model.fp8=false", "model.fp8_params=false"]
    model = build(load_config(ov, validate_cfg=False), vocab, device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (1, 16 if not args.gpu else 128), generator=gen).to(device)

    def backward() -> None:  # the step's cost does not depend on the batch: a short one
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, x)
        loss.backward()

    return model, backward


def build(args: argparse.Namespace) -> tuple[Any, list[torch.nn.Parameter], Any]:
    """The FP8 GPT's optimizer (the fused step), its parameters and a backward."""
    from fp8shard.optim import DistributedFusedAdam

    model, backward = build_model(args)
    params = list(model.parameters())
    scale = 1.0 if args.gpu else sum(p.numel() for p in params) / PARAMS_125M
    kernel = "auto" if args.gpu or args.recipe in TILED else "fused"  # tiled weights: the reference
    opt = DistributedFusedAdam(params, lr=1e-4, weight_decay=0.1, bucket_cap_mb=25 * scale,
                               region_cap_mb=256 * scale, step_kernel=kernel)
    if kernel == "fused":
        opt.engine.kernel.triton = True  # the stub stands in for the kernels
    return opt, params, backward


def _step(opt: Any) -> None:
    opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def cpu(args: argparse.Namespace) -> dict[str, Any]:
    stub = _StubKernels()
    try:
        opt, params, backward = build(args)
        regions = opt.engine.regions
        out: dict[str, Any] = {
            "params": len(params), "fp8_weights": len(opt.engine.fp8.slot),
            "fp8_scales": opt.engine.fp8.num_slots, "regions": len(regions),
            "buckets": sum(len(rb.layout.buckets) for rb in regions),
            "step_kernel": type(opt.engine.kernel).__name__, "recipe": args.recipe,
            "numel": sum(p.numel() for p in params)}
        for _ in range(5):
            backward()
            _step(opt)
        rounds = []
        for _ in range(args.rounds):
            times = []
            for _ in range(args.reps):
                backward()
                t = time.perf_counter()
                _step(opt)
                times.append(time.perf_counter() - t)
            rounds.append(statistics.median(times) * 1e3)
        out["host_ms"] = min(rounds)
        out["host_ms_rounds"] = rounds
        backward()
        stub.launches = 0
        with _CountOps() as counter:
            _step(opt)
        out["torch_ops"] = counter.ops
        out["kernel_launches_stubbed"] = stub.launches
        prof = cProfile.Profile()
        n = 10
        for _ in range(n):
            backward()
            prof.enable()
            _step(opt)
            prof.disable()
        stats = pstats.Stats(prof, stream=io.StringIO())
        out["python_calls"] = stats.total_calls // n  # type: ignore[attr-defined]
        rows = []
        for (file, line, name), (_, _, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
            if "fp8shard" in file:
                rows.append({"function": f"{file.split('fp8shard/')[-1]}:{line}({name})",
                             "cum_ms": ct / n * 1e3, "self_ms": tt / n * 1e3})
        out["top"] = sorted(rows, key=lambda r: -r["cum_ms"])[:args.top]
        return out
    finally:
        stub.restore()


def _timed(step: Any, backward: Any, reps: int) -> dict[str, float]:
    """Median host and wall ms of ``step`` on CUDA, each after a backward of its own."""
    from timing import host_and_wall_seconds

    for _ in range(5):
        backward()
        step()
    host, wall = [], []
    for _ in range(reps):
        backward()
        h, w = host_and_wall_seconds(step, "cuda", warmup=0, reps=1)
        host.append(h)
        wall.append(w)
    return {"host_ms": statistics.median(host) * 1e3, "wall_ms": statistics.median(wall) * 1e3}


def gpu(args: argparse.Namespace) -> dict[str, Any]:
    opt, params, backward = build(args)
    out: dict[str, Any] = {"params": len(params), "fp8_weights": len(opt.engine.fp8.slot)}

    def fused() -> None:
        _step(opt)

    out["fp8shard"] = _timed(fused, backward, args.reps)
    # torch's AdamW on the same GPT as the compiled reference holds it: fp32 weights, bf16 autocast
    model, ref_backward = build_model(args, fp8=False)
    model.float()
    ref_params = list(model.parameters())
    adamw = torch.optim.AdamW(ref_params, lr=1e-4, weight_decay=0.1, fused=True)

    def torch_step() -> None:
        torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        adamw.step()
        adamw.zero_grad(set_to_none=True)

    out["adamw_fused"] = _timed(torch_step, ref_backward, args.reps)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the 125M model on one CUDA device, real kernels")
    ap.add_argument("--width", type=int, default=64, help="hidden size (CPU mode)")
    ap.add_argument("--recipe", default="current", choices=("current", "delayed", *TILED),
                    help="the FP8 weights' recipe (rowwise, blockwise: the reference step kernel, which "
                         "the fused step does not serve; on the CPU its ops then compute)")
    ap.add_argument("--reps", type=int, default=None, help="timed steps (default 50 CPU, 30 GPU)")
    ap.add_argument("--rounds", type=int, default=3, help="CPU mode: repeats, the best median taken")
    ap.add_argument("--top", type=int, default=12, help="functions listed (CPU mode)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.reps = args.reps or (30 if args.gpu else 50)
    torch.manual_seed(0)
    res: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                           "mode": "gpu" if args.gpu else "cpu"}
    if args.gpu:
        res["device"] = torch.cuda.get_device_name()
        res.update(gpu(args))
        print(f"\n125M GPT, world size 1, clip + step + zero_grad ({torch.cuda.get_device_name()})\n")
        print("| optimizer | host ms | wall ms |\n|---|---|---|")
        for name in ("fp8shard", "adamw_fused"):
            print(f"| {name} | {res[name]['host_ms']:.3f} | {res[name]['wall_ms']:.3f} |")
    else:
        res.update(cpu(args))
        how = ("the fused step with its kernels stubbed" if res["step_kernel"] == "FusedKernel" else
               f"the {res['step_kernel']} (its PyTorch ops compute)")
        print(f"\n{res['params']} parameters ({res['fp8_weights']} FP8, {args.recipe}, {res['fp8_scales']} "
              f"scales), {res['buckets']} buckets in {res['regions']} regions; {how}, world size 1\n")
        print("| host ms per step | Python calls | PyTorch ops | kernel launches |\n|---|---|---|---|")
        print(f"| {res['host_ms']:.3f} | {res['python_calls']} | {res['torch_ops']} | "
              f"{res['kernel_launches_stubbed']} |\n")
        print("| function (fp8shard) | cumulative ms | self ms |\n|---|---|---|")
        for r in res["top"]:
            print(f"| {r['function']} | {r['cum_ms']:.3f} | {r['self_ms']:.3f} |")
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()

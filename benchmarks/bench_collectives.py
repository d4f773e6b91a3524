"""FP8 against bf16 parameter all-gather, per bucket size, through the optimizer's own collectives.

    torchrun --nproc-per-node N benchmarks/bench_collectives.py [--sizes-m 1,4,16,64] [--reps 20]
                                                                [--out FILE.json]

NCCL with one GPU per rank when CUDA is there, else gloo on CPU. For each bucket size (elements
of the whole bucket) it times, with the calls ``DistributedFusedAdam`` makes
(``optim.collectives.Group``):

* ``all_gather_inplace`` of the bucket as FP8 bytes (``uint8``, 1 byte per element);
* the same bucket as bf16 (2 bytes per element), what a bf16 parameter all-gather moves;
* ``reduce_scatter_avg`` of a bf16 gradient bucket of the same size (the backward's collective).

Timing: median of ``--reps`` calls after warm-up, each call between barriers (CUDA: events on the
current stream). Bandwidth in the convention of nccl-tests: ``algbw`` = bucket bytes / time,
``busbw`` = algbw x (N-1)/N, what each rank's link carries for a ring all-gather or
reduce-scatter. Once bandwidth-bound, the FP8 gather should take about half the bf16 time; for
small buckets both pay the same latency. Rank 0 prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from fp8shard.optim.collectives import CommCounter, Group


def _time(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, each started together on every rank."""
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        if i >= warmup:
            times.append(t)
    # The slowest rank's median: a collective is as fast as its last participant.
    med = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def run(sizes: list[int], warmup: int, reps: int, device: torch.device) -> list[dict]:
    world = dist.get_world_size()
    group = Group(None, CommCounter())
    rows = []
    for n in sizes:
        n -= n % world  # the optimizer pads buckets to a multiple of the world size
        fp8 = torch.zeros(n, dtype=torch.uint8, device=device)
        bf16 = torch.zeros(n, dtype=torch.bfloat16, device=device)
        grad = torch.ones(n, dtype=torch.bfloat16, device=device)
        shard = grad[group.rank * (n // world):(group.rank + 1) * (n // world)]
        row = {"elements": n}
        for name, fn, nbytes in (
            ("all_gather_fp8", functools.partial(group.all_gather_inplace, fp8, "ag.fp8", async_op=False), n),
            ("all_gather_bf16", functools.partial(group.all_gather_inplace, bf16, "ag.bf16", async_op=False),
             2 * n),
            ("reduce_scatter_bf16",
             lambda s=shard, g=grad: group.reduce_scatter_avg(s, g, "rs.bf16", async_op=False).wait(), 2 * n),
        ):
            sec = _time(fn, device, warmup, reps)
            algbw = nbytes / sec
            row[name] = {"ms": sec * 1e3, "bytes": nbytes, "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * (world - 1) / world / 1e9}
        row["fp8_over_bf16_time"] = row["all_gather_fp8"]["ms"] / row["all_gather_bf16"]["ms"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-m", default="1,4,16,64",
                    help="bucket sizes in millions of elements, comma-separated")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc-per-node 2 "
                         "benchmarks/bench_collectives.py")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    if use_cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        sizes = [int(float(s) * 1e6) for s in args.sizes_m.split(",") if s.strip()]
        rows = run(sizes, args.warmup, args.reps, device)
        if dist.get_rank() == 0:
            world, backend = dist.get_world_size(), dist.get_backend()
            machine = torch.cuda.get_device_name(device) if use_cuda else platform.processor() or "cpu"
            print(f"bench_collectives: world size {world} ({backend}), {machine}, torch {torch.__version__}; "
                  f"median of {args.reps}, busbw = bytes/time x (N-1)/N")
            print(f"{'elements':>10} {'bf16 MB':>8} | {'AG fp8 ms':>9} {'busGB/s':>8} | {'AG bf16 ms':>10} "
                  f"{'busGB/s':>8} | {'fp8/bf16':>8} | {'RS bf16 ms':>10} {'busGB/s':>8}")
            for r in rows:
                a, b, c = r["all_gather_fp8"], r["all_gather_bf16"], r["reduce_scatter_bf16"]
                print(f"{r['elements']:>10} {2 * r['elements'] / 1e6:>8.1f} | {a['ms']:>9.3f} "
                      f"{a['busbw_GBps']:>8.2f} | {b['ms']:>10.3f} {b['busbw_GBps']:>8.2f} | "
                      f"{r['fp8_over_bf16_time']:>8.2f} | {c['ms']:>10.3f} {c['busbw_GBps']:>8.2f}")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"world_size": world, "backend": backend, "machine": machine,
                               "torch": torch.__version__, "reps": args.reps, "rows": rows}, f, indent=2)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

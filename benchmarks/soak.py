"""Soak: does a long run's memory stay flat? Thousands of steps of a tiny GPT, RSS sampled along the way.

    python benchmarks/soak.py [--steps 4000] [--nproc 2] [--sample-every 50] [--warmup 500]
                              [--out FILE.json] [key=value ...]

Runs the training command's ``Trainer`` (the loop ``python -m fp8shard.train`` runs) in-process
(``--nproc 1``) or in ``--nproc`` spawned gloo ranks, on a tiny GPT (2 layers, width 64, 64-token
sequences, global batch 16; FP8 GEMMs with delayed scaling, FP8 weights, DistributedFusedAdam)
with everything a long run does switched on: a metrics record every 100 steps, validation every
1000, a checkpoint every 500 (keep 2), the FP8 overflow monitor, epochs of the data wrapping
around. Extra ``key=value`` arguments override the config.

Every ``--sample-every`` steps each rank reads its resident set size (psutil when installed, else
VmRSS of /proc/self/status). After ``--warmup`` steps (allocator and caches settling), a least
squares line through the samples gives the slope in KB per 1000 steps; a second fit over the
second half of the run tells a plateau (growth that stops: the first checkpoints, validations
and allocator pools) from a leak (growth that goes on). A table per rank goes to stdout;
``--out`` writes the samples and the fits as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.ffn_hidden_size=256",
    "model.encoder_seq_length=64", "model.micro_batch_size=8", "model.global_batch_size=16",
    "data.num_train_tokens=200000", "data.num_val_tokens=20000", "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=100", "trainer.val_check_interval=1000", "checkpoint.every_n_steps=500",
    "checkpoint.keep_last=2", "exp_manager.plots=false", "model.optim.sched.warmup_steps=100",
]


def rss_kb() -> int:
    """Resident set size of this process in KB (psutil, else /proc/self/status)."""
    try:
        import psutil
    except ImportError:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("neither psutil nor /proc/self/status: cannot read RSS here") from None
    return int(psutil.Process().memory_info().rss // 1024)


def fit_slope(samples: list[tuple[int, int]], warmup: int) -> dict[str, float]:
    """Least squares RSS = a + b * step over samples after ``warmup``; b in KB per 1000 steps."""
    pts = [(s, r) for s, r in samples if s >= warmup]
    if len(pts) < 3:
        return {"n": len(pts), "kb_per_1000_steps": float("nan"), "r_first": float("nan"),
                "r_last": float("nan")}
    n = len(pts)
    mx = sum(s for s, _ in pts) / n
    my = sum(r for _, r in pts) / n
    sxx = sum((s - mx) ** 2 for s, _ in pts)
    sxy = sum((s - mx) * (r - my) for s, r in pts)
    slope = sxy / sxx
    resid = [r - (my + slope * (s - mx)) for s, r in pts]
    return {"n": n, "kb_per_1000_steps": 1000 * slope, "resid_max_kb": max(abs(x) for x in resid),
            "rss_after_warmup_kb": pts[0][1], "rss_end_kb": pts[-1][1],
            "rss_max_kb": max(r for _, r in pts)}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from fp8shard.train.config import load_config
    from fp8shard.train.distributed import init_distributed, teardown
    from fp8shard.train.loop import Trainer

    run_dir = Path(out_dir) / "run"
    cfg = load_config([*TINY, *args.overrides, f"trainer.max_steps={args.steps}",
                       f"exp_manager.exp_dir={run_dir.parent}", f"exp_manager.name={run_dir.name}",
                       "trainer.resume=never"], world_size=world)
    env = init_distributed(cfg.trainer.accelerator, cfg.trainer.collective_timeout_s)
    samples: list[tuple[int, int]] = [(0, rss_kb())]
    trainer = Trainer(cfg, env)
    samples.append((0, rss_kb()))
    step_fn = trainer.train_step
    start = time.perf_counter()

    def sampled() -> Any:
        out = step_fn()
        if trainer.step % args.sample_every == 0:
            samples.append((trainer.step, rss_kb()))
        return out

    trainer.train_step = sampled  # type: ignore[method-assign]
    with open(os.devnull, "w") as quiet:  # the progress lines of thousands of steps
        stdout, sys.stdout = sys.stdout, quiet
        try:
            summary = trainer.fit()
        finally:
            sys.stdout = stdout
            trainer.close()  # the run directory's lock
    wall = time.perf_counter() - start
    result = {"rank": rank, "samples": samples, "wall_s": wall, "steps": trainer.step,
              "final_train_loss": summary["final_train_loss"], "val_loss": summary["val_loss"],
              "fp8_overflows": summary.get("fp8_overflows"), "fp8_saturated": summary.get("fp8_saturated")}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    teardown(env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sample-every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=500, help="steps left out of the fit")
    ap.add_argument("--out", default=None, help="write the samples and fits as JSON here")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as out_dir:
        start = time.perf_counter()
        if args.nproc == 1:
            worker(0, 1, _free_port(), args, out_dir)
        else:
            mp.spawn(worker, args=(args.nproc, _free_port(), args, out_dir), nprocs=args.nproc, join=True)
        wall = time.perf_counter() - start
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.nproc)]
    print(f"soak: {args.steps} steps, {args.nproc} rank(s), tiny GPT (FP8 + DistributedFusedAdam), "
          f"RSS every {args.sample_every} steps, fit after step {args.warmup}; {wall:.0f} s")
    header = (f"{'rank':>4} | {'RSS start MB':>12} | {'after warm-up':>13} | {'end MB':>8} | {'max MB':>8} | "
              f"{'slope KB/1000 steps':>19} | {'2nd half':>8} | {'max resid KB':>12} | {'steps/s':>7}")
    print(header)
    print("-" * len(header))
    fits, halves = [], []
    for r in ranks:
        f = fit_slope([tuple(x) for x in r["samples"]], args.warmup)  # type: ignore[misc]
        h = fit_slope([tuple(x) for x in r["samples"]], args.steps // 2)  # type: ignore[misc]
        fits.append(f)
        halves.append(h)
        mb = {k: f[k] / 1024 for k in ("rss_after_warmup_kb", "rss_end_kb", "rss_max_kb")}
        print(f"{r['rank']:>4} | {r['samples'][1][1] / 1024:>12.1f} | {mb['rss_after_warmup_kb']:>13.1f} | "
              f"{mb['rss_end_kb']:>8.1f} | {mb['rss_max_kb']:>8.1f} | {f['kb_per_1000_steps']:>19.1f} | "
              f"{h['kb_per_1000_steps']:>8.1f} | {f['resid_max_kb']:>12.0f} | "
              f"{r['steps'] / r['wall_s']:>7.1f}")
    r0 = ranks[0]
    print(f"final train loss {r0['final_train_loss']:.4f}, validation {r0['val_loss']:.4f}; fp8 overflows "
          f"reported {r0['fp8_overflows']}, saturated operand-steps {r0['fp8_saturated']}")
    if args.out:
        result = {"benchmark": "soak", "argv": sys.argv[1:], "steps": args.steps, "nproc": args.nproc,
                  "sample_every": args.sample_every, "warmup": args.warmup, "wall_s": wall,
                  "config": [*TINY, *args.overrides], "torch": torch.__version__,
                  "python": platform.python_version(), "machine": platform.machine(),
                  "cpus": os.cpu_count(), "ranks": ranks, "fits": fits,
                  "fits_second_half": halves}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Loss parity: does training with FP8 reach bf16's validation loss? (issue 17)

    python benchmarks/parity.py --preset cpu --out runs/parity_cpu
    python benchmarks/parity.py --preset h200-125m --out runs/parity_125m --reuse   # resumable
    python benchmarks/parity.py --preset cpu --data path/to/texts/ --out runs/parity_text

Runs ``python -m fp8shard.train`` once per recipe and seed (the seed is ``model.seed``: the
initial weights; the data, its order and the validation set are the same in every run), reads
each run's final validation loss and curve, prints a table of the runs and one of the verdict
([Note: parity verdict] in fp8shard/parity.py: the mean gap of each FP8 recipe to bf16, in % and
in units of bf16's seed-to-seed sd, within noise when at most max(sd, 0.3%)), writes
``OUT/parity.json`` and draws every validation curve into ``OUT/parity.png``.

Any ``key=value`` arguments after the options are passed to every run (the training command's
overrides, after the preset's). ``--data``: ``markov`` (the generated corpus, default), a folder
or ``tokens.bin`` made by ``python -m fp8shard.data prepare``, or text (a UTF-8 file or a folder
of ``*.txt`` files), which is first prepared into ``OUT/data`` with the repository's byte-level
BPE (``--vocab-size``). docs/numerics.md has the results and the text used.

Runs live in ``OUT/runs/<recipe>-s<seed>``, their output in ``OUT/logs``. A second call with the
same ``--out`` needs ``--reuse``: finished runs (same settings) are read, not rerun; unfinished
ones are run again with ``trainer.resume=auto``, which continues from their newest checkpoint
(the h200-125m preset saves one every 100 steps), so a long benchmark can span several calls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fp8shard.parity import (  # noqa: E402  (after the path set-up above)
    REFERENCE,
    ParityError,
    RunResult,
    compare,
    config_mismatches,
    format_table,
    read_run,
    read_summary,
)

RECIPES: dict[str, list[str]] = {
    "bf16": ["model.fp8=false", "model.fp8_params=false"],
    "fp8-delayed": ["model.fp8=true", "model.fp8_params=true", "model.fp8_layers=all",
                    "model.fp8_recipe=delayed"],
    "fp8-current": ["model.fp8=true", "model.fp8_params=true", "model.fp8_layers=all",
                    "model.fp8_recipe=current"],
    "fp8-rowwise": ["model.fp8=true", "model.fp8_params=true", "model.fp8_layers=all",
                    "model.fp8_recipe=rowwise", "model.fp8_hybrid=false"],
    "fp8-blockwise": ["model.fp8=true", "model.fp8_params=true", "model.fp8_layers=all",
                      "model.fp8_recipe=blockwise", "model.fp8_hybrid=false"],
}
"""Every recipe trains with DistributedFusedAdam under bf16 autocast; the FP8 ones compute the
block projections in FP8 with FP8-stored weights: per tensor (delayed, current: HYBRID, E4M3
forward and E5M2 gradients), or with a scale per row (rowwise) or per 1x128 / 128x128 tile
(blockwise), E4M3 throughout as in torchao's and DeepSeek-V3's recipes, the weights stored with
their row or block scales. Every block projection computes in FP8 (``model.fp8_layers=all``): the
benchmark measures FP8's numerics, also where the GPU default would keep a narrow layer in bf16
([Note: FP8 layer filter])."""

PRESETS: dict[str, dict[str, Any]] = {
    # A 2-layer, 128-wide GPT (438k parameters), 300 steps of 16 x 64 tokens: about 15 s a bf16
    # run and 25 s an FP8 run on a quiet core, so 3 seeds x 3 recipes take about 3 minutes. One
    # thread per run: on a shared machine two threads contend badly (10x slower, measured).
    "cpu": {"seeds": [1, 2, 3], "overrides": [
        "trainer.accelerator=cpu", "trainer.num_threads=1", "trainer.max_steps=300",
        "trainer.val_check_interval=25", "trainer.limit_val_batches=16", "trainer.log_every_n_steps=25",
        "model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=512",
        "model.num_attention_heads=4", "model.encoder_seq_length=64",
        "model.micro_batch_size=16", "model.global_batch_size=16"]},
    # GPT-2 small (presets/gpt_125m.yaml) on one GPU for 1,000 steps of 16 x 1024 tokens (16.4M
    # tokens, under one pass over the generated corpus), compiled, a checkpoint every 250 steps (so a
    # run cut short by a time limit resumes). `--gpus 0,0,0` runs three seeds at once on one GPU.
    "h200-125m": {"seeds": [1, 2, 3], "overrides": [
        "config=gpt_125m", "trainer.accelerator=gpu", "trainer.max_steps=1000",
        "model.micro_batch_size=16", "model.global_batch_size=16",
        "trainer.val_check_interval=100", "trainer.limit_val_batches=8", "trainer.compile=true",
        "checkpoint.every_n_steps=250", "checkpoint.keep_last=1"]},
}


class BenchError(Exception):
    """A problem with the arguments or the output folder; the message says what to do."""


# ---------------------------------------------------------------------------- arguments
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="sizes and steps (default cpu)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help=f"comma-separated, among {', '.join(RECIPES)} (default: all; {REFERENCE} is needed)")
    p.add_argument("--seeds", default=None,
                   help="comma-separated model.seed values (default: the preset's, 1,2,3)")
    p.add_argument("--data", default="markov",
                   help="markov (default), a prepared tokens folder or .bin, or a text file / folder of text")
    p.add_argument("--pattern", default="*.txt", help="--data folder of text: files to take (default *.txt)")
    p.add_argument("--vocab-size", type=int, default=4096, help="--data text: BPE vocabulary (default 4096)")
    p.add_argument("--out", type=Path, required=True,
                   help="output folder: runs/, logs/, parity.json, parity.png")
    p.add_argument("--reuse", action="store_true",
                   help="read the finished runs already in --out, resume the unfinished ones")
    p.add_argument("--jobs", type=int, default=1,
                   help="CPU: runs at a time, each with cores/jobs threads (default 1)")
    p.add_argument("--gpus", default=None,
                   help="comma-separated GPU ids: one run at a time on each (CUDA_VISIBLE_DEVICES)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="passed to every run, after the preset's")
    return p.parse_intermixed_args(argv)  # options may follow the key=value overrides


def check_args(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    recipes = _csv(args.recipes)
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise BenchError(f"unknown recipe(s) {', '.join(unknown)} in --recipes: choose among "
                         f"{', '.join(RECIPES)}")
    if REFERENCE not in recipes:
        raise BenchError(f"--recipes must include {REFERENCE}: every gap is measured against it")
    if len(set(recipes)) != len(recipes):
        raise BenchError(f"--recipes names a recipe twice: {args.recipes}")
    try:
        seeds = [int(s) for s in _csv(args.seeds)] if args.seeds else list(PRESETS[args.preset]["seeds"])
    except ValueError:
        raise BenchError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise BenchError(f"--seeds needs at least 2 different seeds (bf16's spread), got {seeds}")
    bad = [o for o in args.overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise BenchError(f"{bad[0]!r} is not an override: extra arguments are key=value for the "
                         "training command (e.g. trainer.max_steps=100)")
    fixed = {"model.seed", "model.fp8", "model.fp8_params", "model.fp8_recipe", "exp_manager.exp_dir",
             "exp_manager.name", "trainer.resume", "trainer.overwrite"}
    clash = [o for o in args.overrides if o.partition("=")[0] in fixed]
    if clash:
        raise BenchError(f"{clash[0]!r}: the benchmark sets {clash[0].partition('=')[0]} itself "
                         "(use --seeds, --recipes, --out)")
    if args.jobs < 1:
        raise BenchError(f"--jobs must be at least 1, got {args.jobs}")
    return recipes, seeds


# ---------------------------------------------------------------------------- data
def _run(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def data_overrides(args: argparse.Namespace) -> tuple[list[str], str]:
    """(overrides, description) of --data; text is prepared into OUT/data first."""
    if args.data == "markov":
        return [], "markov (generated corpus)"
    src = Path(args.data)
    if not src.exists():
        raise BenchError(f"--data {args.data}: no such file or folder; pass markov, a folder made by "
                         "python -m fp8shard.data prepare, or text (docs/numerics.md says where to get some)")
    prepared = src / "tokens.json" if src.is_dir() else src.with_name("tokens.json")
    if not (prepared.is_file() and (src.is_dir() or src.suffix == ".bin")):
        out = (args.out / "data").resolve()
        if not (args.reuse and (out / "tokens.json").is_file()):
            cmd = [sys.executable, "-m", "fp8shard.data", "prepare", str(src.resolve()), "--out", str(out),
                   "--vocab-size", str(args.vocab_size), "--pattern", args.pattern]
            print(f"preparing {src} with a byte-level BPE of {args.vocab_size} ids -> {out}", flush=True)
            log = args.out / "logs" / "prepare.log"
            if _run(cmd, log, _env()).wait() != 0:
                raise BenchError(f"preparing {src} failed:\n{_tail(log)}")
        prepared = out / "tokens.json"
    meta = json.loads(prepared.read_text())
    # The file, not its folder: what the run's config.yaml records (so --reuse can compare).
    path = (src if src.suffix == ".bin" else prepared.parent / "tokens.bin").resolve()
    desc = (f"{path} ({meta.get('num_tokens', 0):,} tokens, tokenizer {meta.get('tokenizer')}, "
            f"vocabulary {meta['vocab_size']})")
    return [f"data.path={path}", f"data.vocab_size={meta['vocab_size']}"], desc


# ---------------------------------------------------------------------------- runs
def _tail(log: Path, n: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_name(recipe: str, seed: int) -> str:
    return f"{recipe}-s{seed}"


def plan_runs(args: argparse.Namespace, recipes: list[str], seeds: list[int],
              common: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs to start, runs to reuse). Without --reuse an existing run directory is an error."""
    runs_dir = (args.out / "runs").resolve()
    todo, reuse, existing = [], [], []
    for recipe in recipes:
        for seed in seeds:
            name = run_name(recipe, seed)
            overrides = [*common, *RECIPES[recipe], f"model.seed={seed}",
                         f"exp_manager.exp_dir={runs_dir}", f"exp_manager.name={name}"]
            run = {"recipe": recipe, "seed": seed, "name": name, "dir": runs_dir / name,
                   "overrides": overrides}
            if not run["dir"].exists():
                todo.append(run)
                continue
            existing.append(name)
            summary = read_summary(run["dir"]) if args.reuse else None
            if args.reuse and (run["dir"] / "config.yaml").is_file():
                wrong = config_mismatches(run["dir"], overrides)
                if wrong:
                    more = f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""
                    raise BenchError(f"{run['dir']} was made with other settings ({'; '.join(wrong[:3])}"
                                     f"{more}): "
                                     "pass another --out, or delete that run directory")
            if summary is not None and summary.get("steps") == max_steps(run["dir"]):
                reuse.append(run)
            else:
                todo.append(run)
    if existing and not args.reuse:
        raise BenchError(f"{runs_dir} already holds runs ({', '.join(existing[:3])}"
                         f"{' ...' if len(existing) > 3 else ''}): pass --reuse to read the finished ones "
                         "and resume the others, or choose another --out")
    return todo, reuse


def max_steps(run_dir: Path) -> int | None:
    import yaml

    try:
        return int(yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["max_steps"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def read_finished(run_dir: Path) -> RunResult:
    steps = max_steps(run_dir)
    if steps is None:
        raise ParityError(f"{run_dir} has no readable config.yaml: the run never started; see its log")
    return read_run(run_dir, steps)


def execute(todo: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Run the training command for each of ``todo``, ``--jobs`` (or one per ``--gpus``) at a
    time; returns the names of the runs that failed."""
    gpus = _csv(args.gpus) if args.gpus else []
    slots = len(gpus) if gpus else args.jobs
    threads = max(1, (os.cpu_count() or 1) // slots)
    queue: list[dict[str, Any]] = list(todo)
    running: dict[int, tuple[dict[str, Any], subprocess.Popen, float, Path]] = {}
    failed: list[str] = []
    try:
        _loop(queue, running, failed, args, gpus, slots, threads)
    except KeyboardInterrupt:
        # Forward the interrupt as SIGTERM (a terminal's Ctrl-C reaches the runs anyway, a signal
        # sent to this process alone does not, and a run started in the background ignores
        # SIGINT): the training command stops cleanly on it, keeping its checkpoints.
        for _, proc, _, _ in running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _, _ in running.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    return failed


def _loop(queue: list[dict[str, Any]], running: dict[int, Any], failed: list[str], args: argparse.Namespace,
          gpus: list[str], slots: int, threads: int) -> None:
    while queue or running:
        while queue and len(running) < slots:
            run = queue.pop(0)
            slot = next(i for i in range(slots) if i not in running)
            extra = {"CUDA_VISIBLE_DEVICES": gpus[slot]} if gpus else {}
            own = any(o.startswith("trainer.num_threads=") for o in run["overrides"])
            opts = [] if gpus or slots == 1 or own else [f"trainer.num_threads={threads}"]
            cmd = [sys.executable, "-m", "fp8shard.train", *run["overrides"], *opts, "trainer.resume=auto"]
            log = args.out / "logs" / f"{run['name']}.log"
            print(f"start {run['name']}{' (resuming)' if (run['dir'] / 'checkpoints').is_dir() else ''}"
                  f"{' on GPU ' + gpus[slot] if gpus else ''}: log {log}", flush=True)
            running[slot] = (run, _run(cmd, log, _env(extra)), time.perf_counter(), log)
        time.sleep(0.5)
        for slot, (run, proc, t0, log) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[slot]
            took = time.perf_counter() - t0
            if rc == 0:
                print(f"done  {run['name']} in {took:.0f} s", flush=True)
            else:
                failed.append(run["name"])
                print(f"FAILED {run['name']} (exit {rc}) after {took:.0f} s; last lines of {log}:\n"
                      f"{_tail(log)}", flush=True)


# ---------------------------------------------------------------------------- output
def plot(results: dict[str, dict[int, RunResult]], path: Path, title: str) -> str:
    """All validation curves in one PNG: the whole run, and the second half zoomed in."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'fp8shard[plot]')"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colors = dict(zip(results, ["black", "tab:red", "tab:blue", "tab:green", "tab:orange"], strict=False))
    styles = ["-", "--", ":", "-.", (0, (5, 1))]
    markers = ["o", "s", "^", "D", "v", "x", "+"]  # a seed's line style and marker, a recipe's colour
    last = max(r.curve[-1][0] for runs in results.values() for r in runs.values())
    for recipe, runs in results.items():
        for i, (seed, r) in enumerate(sorted(runs.items())):
            for ax, zoom in zip(axes, (False, True), strict=True):
                pts = [(s, v) for s, v in r.curve if s >= last / 2] if zoom else r.curve
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, color=colors[recipe], linestyle=styles[i % len(styles)],
                        marker=markers[i % len(markers)], markersize=3,
                        label=f"{recipe} seed {seed}" if not zoom else None)
    axes[0].set_title("validation loss")
    axes[1].set_title("second half of the run")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def runs_table(results: dict[str, dict[int, RunResult]], reused: set[str]) -> str:
    head = f"{'run':<20} {'val loss':>9} {'bits/byte':>9} {'wall s':>7}  note"
    lines = [head, "-" * len(head)]
    for recipe, runs in results.items():
        for seed, r in sorted(runs.items()):
            name = run_name(recipe, seed)
            bpb = f"{r.val_bpb:.4f}" if r.val_bpb is not None else "-"
            wall = f"{r.wall_s:.0f}" if r.wall_s is not None else "-"
            note = "reused" if name in reused else ""
            lines.append(f"{name:<20} {r.val_loss:>9.4f} {bpb:>9} {wall:>7}  {note}")
    return "\n".join(lines)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the runs as Ctrl-C does
    try:
        recipes, seeds = check_args(args)
        args.out.mkdir(parents=True, exist_ok=True)
        data, data_desc = data_overrides(args)
        common = [*PRESETS[args.preset]["overrides"], *data, "exp_manager.plots=false", *args.overrides]
        todo, reuse = plan_runs(args, recipes, seeds, common)
    except (BenchError, ParityError) as e:
        print(f"parity: error: {e}", file=sys.stderr)
        return 2
    print(f"parity: preset {args.preset}, recipes {', '.join(recipes)}, seeds {seeds}, data {data_desc}; "
          f"{len(todo)} run(s) to do, {len(reuse)} reused", flush=True)
    t0 = time.perf_counter()
    try:
        failed = execute(todo, args)
    except KeyboardInterrupt:
        print("parity: interrupted; the runs stopped, keeping their checkpoints: rerun the same command "
              "with --reuse to go on from them", file=sys.stderr)
        return 130
    if failed:
        print(f"parity: error: {len(failed)} run(s) failed ({', '.join(failed)}): see their logs in "
              f"{args.out / 'logs'}; rerun with --reuse to redo only those", file=sys.stderr)
        return 1
    try:
        results = {rc: {s: read_finished(args.out / "runs" / run_name(rc, s)) for s in seeds}
                   for rc in recipes}
        report = compare({rc: {s: r.val_loss for s, r in by_seed.items()} for rc, by_seed in results.items()})
    except ParityError as e:
        print(f"parity: error: {e}", file=sys.stderr)
        return 1
    steps = results[REFERENCE][seeds[0]].steps
    reused = {r["name"] for r in reuse}
    print()
    print(runs_table(results, reused))
    print()
    print(format_table(report))
    title = (f"parity, preset {args.preset} ({steps} steps), data {data_desc.split(' (')[0]}: "
             f"{', '.join(recipes)} x seeds {seeds}")
    print(plot(results, args.out / "parity.png", title))
    doc = {
        "benchmark": "parity", "argv": sys.argv[1:] if argv is None else argv, "preset": args.preset,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "recipes": {r: RECIPES[r] for r in recipes}, "seeds": seeds, "data": data_desc,
        "overrides": common, "steps": steps, "wall_s": time.perf_counter() - t0,
        "runs": [{"recipe": rc, "seed": s, "reused": run_name(rc, s) in reused, **vars(r)}
                 for rc, by_seed in results.items() for s, r in sorted(by_seed.items())],
        "parity": report.to_dict(),
    }
    path = args.out / "parity.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plots of one or more training runs: ``python -m fp8shard.report RUN_DIR [RUN_DIR ...] [--out DIR]``.

Reads each run directory's metrics.jsonl and summary.json (written by ``python -m
fp8shard.train``) and draws four PNG files:

* ``loss.png``: training loss (lines) and validation loss (dots) of every run on one chart,
  with each run's entropy floor (dashed) when its data has one, a bits-per-byte scale for text
  runs, and, when several runs are compared, a panel of each run's loss minus the first run's
  at the steps both logged;
* ``throughput.png``: tokens/s over the run; the legend's mean covers the whole run (every
  process of a resumed run, without each one's start-up window), and dotted lines mark where
  the run resumed and whether the world size changed there;
* ``memory.png``: persistent bytes per parameter on one rank, by category;
* ``comm.png``: bytes sent per optimizer step by each collective kind (see [Note: comm bytes]
  in fp8shard/train/metrics.py).

matplotlib is optional (``pip install fp8shard[plot]``); without it the command says so and
exits with 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

MEMORY_CATEGORIES = ("weights", "grads", "master", "optimizer_states", "padding")


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingMatplotlib("the report needs matplotlib: pip install matplotlib "
                                "(or pip install 'fp8shard[plot]')") from None
    return plt


def load_run(run_dir: Path) -> dict[str, Any]:
    """{'name', 'metrics': [records], 'summary': {...} or {}} of a run directory."""
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no metrics.jsonl)")
    from fp8shard.train.metrics import read_metrics  # a line cut by a crash is left out

    metrics = read_metrics(metrics_path)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"name": run_dir.name, "metrics": metrics, "summary": summary}


def bpb_factor(run: dict[str, Any]) -> float | None:
    """Bits per byte per nat per token of a text run's validation (None for other runs)."""
    s = run["summary"]
    bpb, val = s.get("val_bpb"), s.get("val_loss")
    return bpb / val if bpb and val else None


def loss_difference(ref: list[dict[str, Any]], other: list[dict[str, Any]],
                    key: str = "loss") -> tuple[list[int], list[float]]:
    """(steps, other's ``key`` minus ref's) at the steps both runs logged it."""
    mine = {r["step"]: r[key] for r in ref if key in r}
    steps = [r["step"] for r in other if key in r and r["step"] in mine]
    theirs = {r["step"]: r[key] for r in other if key in r}
    return steps, [theirs[t] - mine[t] for t in steps]


def _loss_chart(plt: Any, runs: list[dict[str, Any]], out: Path) -> Path:
    """Loss curves; with several runs a panel below shows each run's loss minus the first's."""
    if len(runs) > 1:
        fig, (ax, dax) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.4]})
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
        dax = None
    floors_drawn: set[float] = set()
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        m = run["metrics"]
        ax.plot([r["step"] for r in m], [r["loss"] for r in m], color=color, label=f"{run['name']} train")
        val = [(r["step"], r["val_loss"]) for r in m if "val_loss" in r]
        if val:
            bpb = run["summary"].get("val_bpb")
            extra = f" (last {bpb:.3f} bits/byte)" if bpb else ""
            ax.plot([v[0] for v in val], [v[1] for v in val], "o", color=color,
                    label=f"{run['name']} val{extra}")
        floor = run["summary"].get("entropy_floor")
        if floor is not None and round(floor, 4) not in floors_drawn:
            floors_drawn.add(round(floor, 4))
            ax.axhline(floor, color="k", linestyle="--", linewidth=1, label=f"entropy floor {floor:.3f}")
    factors = {None if f is None else round(f, 6) for f in (bpb_factor(r) for r in runs)}
    f = factors.pop() if len(factors) == 1 else None
    if f is not None:  # text runs on the same data: a bits/byte scale
        sec = ax.secondary_yaxis("right", functions=(lambda x: x * f, lambda x: x / f))
        sec.set_ylabel("bits per byte (validation text)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("loss" if dax is None else f"loss; below: minus {runs[0]['name']}'s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if dax is None:
        ax.set_xlabel("step")
    else:
        ref = runs[0]["metrics"]
        dax.axhline(0.0, color="C0", linewidth=1)
        for i, run in enumerate(runs[1:], start=1):
            color = f"C{i % 10}"
            steps, diff = loss_difference(ref, run["metrics"])
            dax.plot(steps, diff, color=color, label=f"{run['name']} train")
            steps, diff = loss_difference(ref, run["metrics"], "val_loss")
            if steps:
                dax.plot(steps, diff, "o", color=color, label=f"{run['name']} val")
        dax.set_xlabel("step")
        dax.set_ylabel(f"minus {runs[0]['name']}")
        dax.grid(alpha=0.3)
    return _save(plt, fig, out / "loss.png")


def segments(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The records of each process that wrote to the run (a resume starts a new one): split where
    ``start_step`` changes, or, in files without it, where ``elapsed_s`` falls back."""
    out: list[list[dict[str, Any]]] = []
    for r in records:
        new = not out
        if out:
            prev = out[-1][-1]
            if "start_step" in r or "start_step" in prev:
                new = r.get("start_step") != prev.get("start_step")
            else:
                new = r.get("elapsed_s", 0.0) < prev.get("elapsed_s", 0.0)
            new = new or r.get("world_size") != prev.get("world_size")
        if new:
            out.append([r])
        else:
            out[-1].append(r)
    return out


def run_throughput(records: list[dict[str, Any]]) -> float | None:
    """Tokens/s of the whole run: the tokens of every logging window over their seconds, leaving
    out the first window of each process (its start-up), as summary.json does for one process."""
    tokens = seconds = 0.0
    segs = segments(records)
    for seg in segs:
        for k, r in enumerate(seg):
            if k == 0 and (len(segs) > 1 or len(seg) > 1):
                continue  # the start-up window (kept only when it is all there is)
            rate, step = r.get("tokens_per_s"), r.get("step")
            if not rate or not step:
                continue
            before = seg[k - 1]["step"] if k else r.get("start_step", 0)
            n = (step - before) * r.get("tokens", 0) / step
            tokens += n
            seconds += n / rate
    return tokens / seconds if seconds else None


def _throughput_chart(plt: Any, runs: list[dict[str, Any]], out: Path) -> Path:
    """Tokens/s; the legend gives the whole run's figure, dotted lines mark where a run resumed
    (and whether the world size changed there)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(runs):
        m = run["metrics"]
        color = f"C{i % 10}"
        mean = run_throughput(m)
        segs = segments(m)
        label = run["name"] + (f" (mean {mean:,.0f} tok/s over the run)" if mean else "")
        if len(segs) > 1:
            label += f", {len(segs) - 1} resume(s)"
        ax.plot([r["step"] for r in m], [r["tokens_per_s"] for r in m], color=color, label=label)
        for before, seg in itertools.pairwise(segs):
            at = seg[0].get("start_step", before[-1]["step"])
            ax.axvline(at, color=color, linestyle=":", linewidth=1.2)
            w0, w1 = before[-1].get("world_size"), seg[0].get("world_size")
            text = "resumed" if w0 == w1 or w0 is None or w1 is None else f"resumed: {w0} -> {w1} ranks"
            ax.annotate(text, (at, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                        textcoords="offset points", fontsize=8, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(plt, fig, out / "throughput.png")


def _stacked_bars_figure(plt: Any, names: list[str], parts: list[dict[str, float]], keys: list[str],
                         xlabel: str, title: str) -> tuple[Any, Any, Any]:
    """(figure, axes, legend or None): horizontal stacked bars, the legend below the x label."""
    fig, ax = plt.subplots(figsize=(8, 2.0 + 0.6 * len(names)))
    left = [0.0] * len(names)
    for j, key in enumerate(keys):
        widths = [p.get(key, 0.0) for p in parts]
        ax.barh(names, widths, left=left, color=f"C{j % 10}", label=key)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:,.2f}", va="center", fontsize=8)
    ax.set_xlim(0, max([*left, 1e-9]) * 1.15)  # room for the totals
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")
    legend = None
    if keys:
        # Below the x label, wherever it ended up: measured after a draw, in axes coordinates.
        fig.tight_layout()
        renderer = fig.canvas.get_renderer()
        label = ax.xaxis.label.get_window_extent(renderer)
        y = ax.transAxes.inverted().transform((0.0, label.y0))[1]
        legend = ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, y - 0.02),
                           ncol=min(len(keys), 4))
    return fig, ax, legend


def _stacked_bars(plt: Any, names: list[str], parts: list[dict[str, float]], keys: list[str],
                  xlabel: str, title: str, path: Path) -> Path:
    fig, _, _ = _stacked_bars_figure(plt, names, parts, keys, xlabel, title)
    return _save(plt, fig, path, tight_layout=False)  # laid out before the legend was placed


def _memory_chart(plt: Any, runs: list[dict[str, Any]], out: Path) -> Path:
    parts = [run["summary"].get("bytes_per_param", {}) for run in runs]
    keys = [k for k in MEMORY_CATEGORIES if any(p.get(k) for p in parts)]
    return _stacked_bars(plt, [r["name"] for r in runs], parts, keys, "bytes per parameter on one rank",
                         "persistent memory by category", out / "memory.png")


def _comm_chart(plt: Any, runs: list[dict[str, Any]], out: Path) -> Path:
    parts = [{k: v / 2**20 for k, v in run["summary"].get("wire_bytes_per_step", {}).items()} for run in runs]
    keys = sorted({k for p in parts for k in p})
    return _stacked_bars(plt, [r["name"] for r in runs], parts, keys,
                         "MiB sent per rank per optimizer step (ring)", "communication by collective",
                         out / "comm.png")


def _save(plt: Any, fig: Any, path: Path, tight_layout: bool = True) -> Path:
    """Save with every artist inside the image (a legend below the axes included)."""
    if tight_layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path


def make_report(run_dirs: list[Path], out: Path) -> list[Path]:
    """Draw the four charts of ``run_dirs`` into ``out``; returns the PNG paths."""
    runs = [load_run(Path(d)) for d in run_dirs]
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    return [_loss_chart(plt, runs, out), _throughput_chart(plt, runs, out),
            _memory_chart(plt, runs, out), _comm_chart(plt, runs, out)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8shard.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (exp_dir/name)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: RUN_DIR/plots for one run, ./report for several)")
    args = parser.parse_args(argv)
    out = args.out or (args.run_dirs[0] / "plots" if len(args.run_dirs) == 1 else Path("report"))
    try:
        paths = make_report(args.run_dirs, out)
    except (MissingMatplotlib, FileNotFoundError) as e:
        print(f"fp8shard.report: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())

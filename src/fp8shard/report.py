"""Plots of one or more training runs: ``python -m fp8shard.report RUN_DIR [RUN_DIR ...] [--out DIR]``.

Reads each run directory's metrics.jsonl and summary.json (written by ``python -m
fp8shard.train``) and draws four PNG files:

* ``loss.png``: training loss (lines) and validation loss (dots) of every run on one chart,
  with each run's entropy floor (dashed) when its data has one;
* ``throughput.png``: tokens/s over the run;
* ``memory.png``: persistent bytes per parameter on one rank, by category;
* ``comm.png``: bytes sent per optimizer step by each collective kind (see [Note: comm bytes]
  in fp8shard/train/metrics.py).

matplotlib is optional (``pip install fp8shard[plot]``); without it the command says so and
exits with 2.
"""

from __future__ import annotations

import argparse
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


def _loss_chart(plt: Any, runs: list[dict[str, Any]], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    floors_drawn: set[float] = set()
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        m = run["metrics"]
        ax.plot([r["step"] for r in m], [r["loss"] for r in m], color=color, label=f"{run['name']} train")
        val = [(r["step"], r["val_loss"]) for r in m if "val_loss" in r]
        if val:
            ax.plot([v[0] for v in val], [v[1] for v in val], "o", color=color, label=f"{run['name']} val")
        floor = run["summary"].get("entropy_floor")
        if floor is not None and round(floor, 4) not in floors_drawn:
            floors_drawn.add(round(floor, 4))
            ax.axhline(floor, color="k", linestyle="--", linewidth=1, label=f"entropy floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "loss.png")


def _throughput_chart(plt: Any, runs: list[dict[str, Any]], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(runs):
        m = run["metrics"]
        mean = run["summary"].get("tokens_per_s")
        label = run["name"] + (f" (mean {mean:,.0f})" if mean else "")
        ax.plot([r["step"] for r in m], [r["tokens_per_s"] for r in m], color=f"C{i % 10}", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "throughput.png")


def _stacked_bars(plt: Any, names: list[str], parts: list[dict[str, float]], keys: list[str],
                  xlabel: str, title: str, path: Path) -> Path:
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
    if keys:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=min(len(keys), 4))
    ax.grid(alpha=0.3, axis="x")
    return _save(plt, fig, path)


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


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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

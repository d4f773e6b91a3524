"""Draw the run's plots at the end of training, when matplotlib is installed."""

from __future__ import annotations

from pathlib import Path


def draw_plots(run_dir: Path) -> None:
    from fp8shard.report import MissingMatplotlib, make_report

    try:
        paths = make_report([run_dir], run_dir / "plots")
    except MissingMatplotlib as e:
        print(f"plots: skipped ({e})", flush=True)
        return
    print(f"plots: {run_dir / 'plots'} ({', '.join(p.name for p in paths)})", flush=True)

"""The report's plots: the difference panel, throughput over a resumed run (its whole-run mean and
the resume markers), a bits-per-byte scale for text runs, and legends that clip nothing."""

from __future__ import annotations

import json

import pytest

from fp8shard import report
from tests.use.common import train

pytest.importorskip("matplotlib")


def _write_run(path, records, summary):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _records(steps, rate, start_step, world_size, loss=lambda s: 5.0 - s / 100, first_rate=None):
    out = []
    for i, s in enumerate(steps):
        r = first_rate if i == 0 and first_rate else rate
        out.append({"step": s, "loss": loss(s), "lr": 1e-3, "tokens_per_s": r, "tokens": s * 1000,
                    "elapsed_s": 1.0 + i, "start_step": start_step,
                    "world_size": world_size, **({"val_loss": loss(s) - 0.1} if s % 50 == 0 else {})})
    return out


@pytest.fixture
def figures(monkeypatch):
    """{png name: the figure}, captured as the report saves them."""
    seen = {}
    real = report._save

    def save(plt, fig, path, tight_layout=True):
        seen[path.name] = fig
        fig.canvas.draw()
        texts = [t.get_text() for ax in fig.axes for leg in [ax.get_legend()] if leg for t in leg.get_texts()]
        texts += [t.get_text() for ax in fig.axes for t in ax.texts]
        fig.captured_texts = texts
        return real(plt, fig, path, tight_layout)

    monkeypatch.setattr(report, "_save", save)
    return seen


def test_a_resumed_run_shows_its_whole_throughput_and_where_it_resumed(tmp_path, figures):
    # 50 steps on 1 rank at 1,000 tok/s, resumed at step 50 on 2 ranks at 3,000 tok/s; the first
    # window of each process is slow (start-up) and left out of the mean.
    records = (_records(range(10, 51, 10), 1000.0, 0, 1, first_rate=100.0)
               + _records(range(60, 101, 10), 3000.0, 50, 2, first_rate=50.0))
    run = _write_run(tmp_path / "resumed", records, {"tokens_per_s": 3000.0})  # the last process's own
    assert [len(s) for s in report.segments(records)] == [5, 5]
    assert report.run_throughput(records) == pytest.approx(80_000 / (40 + 40 / 3))  # 1,500
    paths = report.make_report([run], tmp_path / "plots")
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)
    texts = figures["throughput.png"].captured_texts
    assert "resumed (mean 1,500 tok/s over the run), 1 resume(s)" in texts
    assert "resumed: 1 -> 2 ranks" in texts


def test_a_real_resumed_run(tmp_path, figures):
    run_dir = tmp_path / "r"
    common = ("checkpoint.every_n_steps=2", "data.num_train_tokens=20000", "data.num_val_tokens=5000")
    train(run_dir, "trainer.max_steps=4", *common)
    train(run_dir, "trainer.max_steps=6", *common)  # resumes from step 4
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["start_step"] for r in records] == [0, 0, 0, 0, 4, 4]
    assert [r["world_size"] for r in records] == [1] * 6
    report.make_report([run_dir], tmp_path / "plots")
    mean = report.run_throughput(records)
    texts = figures["throughput.png"].captured_texts
    assert f"r (mean {mean:,.0f} tok/s over the run), 1 resume(s)" in texts and "resumed" in texts


def test_compared_runs_get_a_difference_panel(tmp_path, figures):
    a = _write_run(tmp_path / "a", _records(range(10, 101, 10), 1000.0, 0, 1), {})
    b = _write_run(tmp_path / "b", _records(range(10, 101, 10), 1000.0, 0, 1, loss=lambda s: 5.02 - s / 100),
                   {})
    report.make_report([a, b], tmp_path / "plots")
    fig = figures["loss.png"]
    _, diff = fig.axes
    assert diff.get_ylabel() == "minus a"
    line = diff.get_lines()[1]  # [0] is the zero line
    assert list(line.get_xdata()) == list(range(10, 101, 10))
    assert list(line.get_ydata()) == pytest.approx([0.02] * 10)
    steps, d = report.loss_difference(_records([10, 20, 30], 1.0, 0, 1), _records([20, 30, 40], 1.0, 0, 1))
    assert steps == [20, 30] and d == [0.0, 0.0]


def test_text_runs_get_a_bits_per_byte_scale(tmp_path, figures):
    run = _write_run(tmp_path / "t", _records(range(10, 101, 10), 1000.0, 0, 1),
                     {"val_loss": 2.0, "val_bpb": 1.5})
    report.make_report([run], tmp_path / "plots")
    fig = figures["loss.png"]
    labels = [a.get_ylabel() for ax in fig.axes for a in [ax, *ax.child_axes]]
    assert "bits per byte (validation text)" in labels
    assert "t val (last 1.500 bits/byte)" in fig.captured_texts


def test_a_single_runs_bar_legend_clips_nothing(tmp_path):
    plt = report._pyplot()
    parts = {"all_gather.params": 1.0, "reduce_scatter.grads": 2.0, "all_reduce.amax": 0.1}
    fig, ax, legend = report._stacked_bars_figure(plt, ["one run"], [parts], sorted(parts),
                                                  "MiB sent per rank per step", "comm")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    label, box = ax.xaxis.label.get_window_extent(renderer), legend.get_window_extent(renderer)
    assert box.y1 <= label.y0  # below the x label, not over it
    saved = fig.get_tightbbox(renderer)  # what bbox_inches="tight" keeps, in inches
    assert saved.y0 * fig.dpi <= box.y0 and box.y1 <= saved.y1 * fig.dpi
    plt.close(fig)

"""The training command end to end: one process and two ranks under torchrun, then the report."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.train.helpers import TINY, read_metrics, read_summary, run_train

STEPS = 30
OVERRIDES = [*TINY, f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=5",
             "trainer.val_check_interval=15", "model.optim.sched.warmup_steps=5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The default configuration (FP8 GEMMs, FP8 weights, DistributedFusedAdam), tiny, 1 and 2 ranks."""
    root = tmp_path_factory.mktemp("e2e")
    out = {}
    for nproc in (1, 2):
        run_dir = root / f"ranks{nproc}"
        proc = run_train(run_dir, OVERRIDES, nproc=nproc)
        out[nproc] = (run_dir, proc)
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_run_directory_files_exist_and_parse(runs, nproc):
    run_dir, _ = runs[nproc]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["model"]["num_layers"] == 2 and cfg["model"]["fp8_params"] is True
    metrics = read_metrics(run_dir)
    assert [r["step"] for r in metrics] == list(range(5, STEPS + 1, 5))
    for r in metrics:
        assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "skipped"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["skipped"] is False
    assert [r["step"] for r in metrics if "val_loss" in r] == [15, 30]
    s = read_summary(run_dir)
    assert s["world_size"] == nproc and s["steps"] == STEPS
    assert s["fp8"]["fp8"] and s["fp8"]["fp8_params"] and s["optimizer"] == "distributed_fused_adam"
    assert s["val_loss"] == metrics[-1]["val_loss"]
    assert 0.5 < s["entropy_floor"] < 2.5
    assert s["tokens_per_s"] > 0 and s["peak_memory_bytes"] > 0


@pytest.mark.parametrize("nproc", [1, 2])
def test_loss_falls(runs, nproc):
    metrics = read_metrics(runs[nproc][0])
    assert metrics[0]["loss"] > 5.0  # ln(256) = 5.55 at init
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 1.0
    assert metrics[-1]["val_loss"] < metrics[0]["loss"] - 1.0


def test_one_and_two_ranks_see_the_same_batches_so_the_curves_agree(runs):
    one, two = read_metrics(runs[1][0]), read_metrics(runs[2][0])
    for a, b in zip(one, two, strict=True):
        # Same global batches; only bf16 gradient averaging differs (observed <= 1e-4 relative).
        assert a["loss"] == pytest.approx(b["loss"], rel=3e-3), a["step"]


def test_memory_and_comm_are_reported_per_category(runs):
    s1, s2 = read_summary(runs[1][0]), read_summary(runs[2][0])
    b1, b2 = s1["bytes_per_param"], s2["bytes_per_param"]
    assert set(b1) >= {"weights", "grads", "master", "optimizer_states"}
    assert 1.0 <= b1["weights"] < 2.0  # FP8 projections (1 B) + bf16 embeddings and norms (2 B)
    assert b1["grads"] == pytest.approx(2.0, abs=0.2)  # bf16 gradient buffers
    # Sharding halves the FP32 master and the Adam states on 2 ranks: 4 -> 2 and 8 -> 4 B/param.
    assert b1["master"] == pytest.approx(4.0, abs=0.2) and b2["master"] == pytest.approx(2.0, abs=0.2)
    assert b2["optimizer_states"] == pytest.approx(b1["optimizer_states"] / 2, rel=0.05)
    comm = s2["comm_bytes_per_step"]
    n = s2["num_params"]
    fp8_gather = comm["all_gather.params.float8_e4m3fn"]
    assert 0.5 * n < fp8_gather < n  # one byte per FP8 weight element on the wire
    assert comm["reduce_scatter.grads"] >= 2 * n  # bf16 gradients
    wire = s2["wire_bytes_per_step"]["reduce_scatter.grads"]
    assert wire == pytest.approx(comm["reduce_scatter.grads"] / 2)  # ring: (N - 1) / N
    assert all(v == 0 for v in s1["wire_bytes_per_step"].values())


def test_progress_line_and_summary_are_printed_once(runs):
    _, proc = runs[2]
    lines = [ln for ln in proc.stdout.splitlines() if "tok/s" in ln and "ETA" in ln]
    assert len(lines) == STEPS // 5  # rank 0 only
    assert "entropy floor" in proc.stdout and "summary.json" in proc.stdout


def test_report_draws_non_empty_pngs(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "fp8shard.report", str(runs[1][0]), str(runs[2][0]),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "throughput.png", "memory.png", "comm.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert str(out / "loss.png") in proc.stdout


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fp8shard.report", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "not a run directory" in proc.stderr


def test_report_without_matplotlib_says_how_to_install_it(runs, tmp_path, monkeypatch):
    from fp8shard import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(report.MissingMatplotlib, match="pip install matplotlib"):
        report.make_report([runs[1][0]], tmp_path)
    assert report.main([str(runs[1][0]), "--out", str(tmp_path)]) == 2

"""Which FP8 GEMM path serves on CPU ([Note: CPU GEMM choice]), and that the paths agree.

The auto choice is checked against a ``torch._scaled_mm`` made slow or fast on purpose, so the
test means the same on every CPU: it would fail if auto kept the reference kernel of a CPU
without FP8 (issue 15), or refused a fast one.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

import fp8shard as fs
from fp8shard.fp8 import gemm
from fp8shard.fp8.gemm import fp8_mm
from fp8shard.train.__main__ import main
from tests.train.helpers import TINY


@pytest.fixture
def fresh_choice(monkeypatch):
    """A process that has not measured yet, with the setting restored afterwards."""
    monkeypatch.setattr(gemm, "_cpu_auto", {})
    before = gemm.get_fp8_gemm()
    yield
    gemm.set_fp8_gemm(before)


def _slowed(fn, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def test_auto_on_cpu_picks_emulated_when_scaled_mm_measures_slower(fresh_choice, monkeypatch):
    # a reference kernel; a quarter second, so that a loaded machine (the emulated path measured
    # at its best of 3) cannot make it look fast: 20 ms once did under two busy test workers
    monkeypatch.setattr(torch, "_scaled_mm", _slowed(torch._scaled_mm, 0.25))
    assert gemm.choose_gemm_path("cpu", 0, 64, 64, 64) == "emulated"
    choice = gemm.cpu_gemm_choice()
    assert choice["path"] == "emulated" and choice["scaled_mm_ms"] > choice["emulated_ms"]


def test_auto_on_cpu_keeps_scaled_mm_where_it_measures_faster(fresh_choice, monkeypatch):
    # The measurement is replaced (not slowed): on a CPU whose oneDNN runs the reference FP8
    # kernel (~1 s a call here) no fixed delay of the emulated path makes scaled_mm win.
    monkeypatch.setattr(gemm, "measure_cpu_gemm", lambda: {"scaled_mm_ms": 0.5, "emulated_ms": 1.0})
    assert gemm.choose_gemm_path("cpu", 0, 64, 64, 64) == "scaled_mm"
    assert gemm.resolved_gemm_path("cpu") == "scaled_mm"


def test_auto_measures_once_per_process(fresh_choice, monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "measure_cpu_gemm", lambda: calls.append(1) or
                        {"scaled_mm_ms": 2.0, "emulated_ms": 1.0})
    for _ in range(3):
        assert gemm.choose_gemm_path("cpu", 0, 32, 32, 32) == "emulated"
    assert calls == [1]


def test_the_setting_forces_either_path_and_rejects_others(fresh_choice, monkeypatch):
    monkeypatch.setattr(gemm, "measure_cpu_gemm", lambda: pytest.fail("a forced path measures nothing"))
    fs.set_fp8_gemm("scaled_mm")
    assert gemm.choose_gemm_path("cpu", 0, 7, 9, 11) == "scaled_mm"
    fs.set_fp8_gemm("emulated")
    assert fs.get_fp8_gemm() == "emulated"
    assert gemm.choose_gemm_path("cpu", 0, 16, 16, 16) == "emulated"
    assert gemm.choose_gemm_path("cuda", 0, 16, 16, 16) == "emulated"
    with pytest.raises(ValueError, match="unknown FP8 GEMM setting 'fast'; choose one of auto"):
        fs.set_fp8_gemm("fast")


@pytest.mark.parametrize("fmt_b", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("m,k,n", [(16, 32, 48), (7, 64, 5), (33, 16, 64)])
def test_emulated_and_scaled_mm_agree_bit_for_bit_on_exact_sums(fresh_choice, m, k, n, fmt_b):
    # Small integers are exact in E4M3/E5M2, and their products' sums (< 2**24) are exact in
    # fp32 in any order; power-of-two scales are exact too. So the two paths must agree bit for
    # bit, whatever order each sums in.
    gen = torch.Generator().manual_seed(m * k + n)
    a = torch.randint(-8, 9, (m, k), generator=gen).float().to(torch.float8_e4m3fn)
    b = torch.randint(-8, 9, (n, k), generator=gen).float().to(fmt_b).t()
    sa, sb = torch.tensor(0.25), torch.tensor(4.0)
    out = {}
    for path in ("scaled_mm", "emulated"):
        fs.set_fp8_gemm(path)
        out[path] = fp8_mm(a, sa, b, sb, torch.float32)
    assert torch.equal(out["scaled_mm"], out["emulated"])
    assert torch.equal(out["emulated"], (a.float() @ b.float()))


def test_emulated_and_scaled_mm_agree_to_fp32_summation_order_on_random_values(fresh_choice):
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 256, generator=gen) * 3).to(torch.float8_e4m3fn)
    b = torch.randn(96, 256, generator=gen).to(torch.float8_e5m2).t()
    sa, sb = torch.tensor(0.37), torch.tensor(1.9)
    exact = (a.double() @ b.double()) * (0.37 * 1.9)
    for path in ("scaled_mm", "emulated"):
        fs.set_fp8_gemm(path)
        got = fp8_mm(a, sa, b, sb, torch.float32).double()
        # fp32 sums of 256 terms: a few ulps of the sum of magnitudes.
        bound = 256 * 2**-24 * ((a.double().abs() @ b.double().abs()) * (0.37 * 1.9))
        assert ((got - exact).abs() <= bound + 1e-30).all(), path


def _train_counting(tmp_path, monkeypatch, overrides: list[str]) -> tuple[dict, int]:
    calls = []
    original = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    args = [*TINY, "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            f"exp_manager.exp_dir={tmp_path}", "exp_manager.name=run", *overrides]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    return summary, len(calls)


def test_training_reports_the_auto_choice_and_uses_it(fresh_choice, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gemm, "measure_cpu_gemm", lambda: {"scaled_mm_ms": 500.0, "emulated_ms": 1.0})
    summary, scaled_calls = _train_counting(tmp_path, monkeypatch, [])
    compute = summary["compute"]
    assert compute["fp8_gemm"] == "auto" and compute["fp8_gemm_path"] == "emulated"
    assert compute["fp8_gemm_timings_ms"] == {"scaled_mm_ms": 500.0, "emulated_ms": 1.0}
    assert scaled_calls == 0  # not one GEMM of the run went to the slow kernel
    first = capsys.readouterr().out.splitlines()[0]
    assert "FP8 GEMMs emulated (auto: _scaled_mm 500.00 ms vs emulated 1.00 ms)" in first


@pytest.mark.parametrize("setting", ["scaled_mm", "emulated"])
def test_training_config_key_forces_the_path(fresh_choice, tmp_path, monkeypatch, setting):
    monkeypatch.setattr(gemm, "measure_cpu_gemm", lambda: pytest.fail("a forced path measures nothing"))
    summary, scaled_calls = _train_counting(tmp_path, monkeypatch, [f"model.fp8_gemm={setting}"])
    assert summary["compute"]["fp8_gemm_path"] == setting
    assert (scaled_calls > 0) == (setting == "scaled_mm")


def test_training_sets_the_thread_count(fresh_choice, tmp_path, monkeypatch):
    before = torch.get_num_threads()
    try:
        overrides = ["trainer.num_threads=1", "model.fp8_gemm=emulated"]
        summary, _ = _train_counting(tmp_path, monkeypatch, overrides)
        assert summary["compute"]["num_threads"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_auto_threads_share_the_cpus_among_the_ranks_of_a_node(monkeypatch):
    from fp8shard.train.builders import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads("auto") == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert cpu_threads("auto") == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads("auto") == 3
    assert cpu_threads(5) == 5

"""benchmarks/bench_tiled_wire.py: its count equals what a real DistributedFusedAdam step moves,
and with 1.3B-like shapes the parameter all-gather with row or block scales stays at most
1.01 bytes per weight ([Note: tiled weight casts])."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optim import tiled_cases

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tiled_wire.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_tiled_wire", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("recipe", ["current", "rowwise", "blockwise"])
def test_count_is_what_the_optimizer_moves(recipe):
    measured = tiled_cases.one_step_against_reference(recipe, bucket_cap_mb=25.0)["bytes_per_weight"]
    counted = _module().bytes_per_weight("tensorwise" if recipe == "current" else recipe,
                                         list(tiled_cases.SHAPES), 1)
    assert counted == pytest.approx(measured, rel=1e-12)


def test_1p3b_shapes_gather_at_most_1p01_bytes_per_weight(tmp_path):
    out = tmp_path / "wire.json"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, capture_output=True,
                   timeout=120)
    rows = [r for r in json.loads(out.read_text())["bytes_per_weight"] if r["shapes"].startswith("1.3B")]
    assert {r["world_size"] for r in rows} == {1, 2, 8}
    for r in rows:
        assert 1.0 <= r["tensorwise"] <= r["blockwise"] <= r["rowwise"] <= 1.01, r

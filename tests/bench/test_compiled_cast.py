"""benchmarks/bench_compiled_cast.py on the CPU at toy sizes: every site, scaling and amax form
runs compiled, and the two amax forms give the same FP8 bytes and scales."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_compiled_cast
from fp8shard.fp8 import quantizer


def test_every_site_scaling_and_amax_form_runs_and_agrees(tmp_path):
    out = tmp_path / "cast.json"
    result = bench_compiled_cast.main(["--device", "cpu", "--tokens", "64", "--hidden", "32",
                                       "--ffn", "96", "--reps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == result["rows"] and len(rows) == 3 * 2 * 2
    want = {(s, sc, a) for s in bench_compiled_cast.SITES
            for sc in ("current", "delayed") for a in ("rows", "whole")}
    assert {(r["site"], r["scaling"], r["amax"]) for r in rows} == want
    assert all(r["same_bytes"] and r["ms"] > 0 for r in rows)
    assert quantizer.amax is bench_compiled_cast.ROWS_AMAX  # the library's amax is put back

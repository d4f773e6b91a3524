"""benchmarks/bench_generate.py at its small size: both ways sample, and the same tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_generate


def test_sampling_is_timed_both_ways_and_agrees(tmp_path, capsys):
    out = tmp_path / "gen.json"
    res = bench_generate.main(["--small", "--tokens", "5,70", "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert [r["new_tokens"] for r in res["rows"]] == [5, 70]  # 70: past the 64-position window
    for r in res["rows"]:
        assert r["same_tokens"] and r["cache_s"] > 0 and r["speedup"] == r["no_cache_s"] / r["cache_s"]
    assert "speed-up" in capsys.readouterr().out

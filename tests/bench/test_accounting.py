"""benchmarks/accounting.py's replay of a CUDA memory trace, on a trace written by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from accounting import peak_live_blocks


def _frames(filename: str, line: int, name: str) -> list[dict]:
    # innermost first, as torch records them: a torch frame, then the one that says what it is for
    return [{"filename": "/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": filename, "line": line, "name": name}]


def test_live_at_peak_groups_by_allocation_site_and_ignores_later_frees() -> None:
    mb = 2**20
    logits = _frames("/src/fp8shard/models/loss.py", 80, "_chunks")
    act = _frames("/src/fp8shard/models/gpt.py", 120, "forward")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100 * mb, "frames": act},
        {"action": "alloc", "addr": 2, "size": 300 * mb, "frames": logits},
        {"action": "alloc", "addr": 3, "size": 300 * mb, "frames": logits},
        {"action": "free_requested", "addr": 2, "size": 300 * mb},  # not yet given back
        {"action": "alloc", "addr": 4, "size": 50 * mb, "frames": act},  # the peak: 750 MB
        {"action": "free_completed", "addr": 2, "size": 300 * mb},
        {"action": "free_completed", "addr": 3, "size": 300 * mb},
        {"action": "alloc", "addr": 5, "size": 400 * mb, "frames": act},  # 550 MB: below the peak
        {"action": "segment_alloc", "addr": 9, "size": 2000 * mb},  # reserved, not allocated
    ]
    out = peak_live_blocks({"device_traces": [trace]})
    assert out["peak_mb"] == 750
    assert [(g["mb"], g["blocks"]) for g in out["groups"]] == [(600, 2), (150, 2)]
    assert out["groups"][0]["where"].startswith("loss.py:80 _chunks")
    assert out["groups"][1]["where"].startswith("gpt.py:120 forward")


def test_an_empty_trace_has_no_peak() -> None:
    assert peak_live_blocks({"device_traces": [[]]}) == {"peak_mb": 0.0, "groups": []}
    assert peak_live_blocks({}) == {"peak_mb": 0.0, "groups": []}

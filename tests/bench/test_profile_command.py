"""benchmarks/profile_command.py on the CPU at the command's default (toy) sizes: both arms build
the training command's Trainer in processes of their own and profile its steps; the table, the
differences and the JSON agree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_command


def test_both_arms_profile_the_commands_steps(tmp_path, capsys):
    out = tmp_path / "command.json"
    result = profile_command.main(["--config", "defaults", "--steps", "2", "--warmup", "1", "--top", "4",
                                   "--set", "model.num_layers=2", "trainer.accelerator=cpu",
                                   "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    arms = result["arms"]
    assert set(arms) == {"fp8", "bf16"}
    # the FP8 arm stores the block projections in FP8 (4 a block), the bf16 arm none
    assert (arms["fp8"]["fp8_weights"], arms["bf16"]["fp8_weights"]) == (8, 0)
    for arm in arms.values():
        assert arm["device"] == "cpu" and arm["step_ms"] > 0 and arm["tokens_per_s"] > 0
        assert arm["gpu_busy_ms"] is None and arm["host_syncs"] == {}  # no device apart
    # the FP8 arm runs ops the bf16 arm does not (its weights' dequantize and casts): they are listed
    assert result["diffs"]["count"] and len(result["diffs"]["host_us"]) <= 4
    text = capsys.readouterr().out
    assert "fp8 / bf16" in text and "the events that differ most" in text


def test_timing_only_and_the_traces(tmp_path):
    """``--no-profile`` times the steps and profiles none (no events, no busy time);
    ``--trace`` writes each arm's Chrome trace of its profiled steps."""
    base = ["--config", "defaults", "--steps", "1", "--warmup", "1", "--set", "model.num_layers=2",
            "trainer.accelerator=cpu"]
    timed = profile_command.main([*base, "--no-profile"])
    for arm in timed["arms"].values():
        assert arm["step_ms"] > 0 and arm["launches"] is None and arm["peak_mib"] is None
    assert not any(timed["diffs"].values())
    profile_command.main([*base, "--trace", str(tmp_path)])
    for arm in ("fp8", "bf16"):
        trace = json.loads((tmp_path / f"{arm}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert any(str(n).startswith("aten::") for n in names), arm

"""benchmarks/bench_host_overhead.py on the CPU at toy sizes: both arms run in processes of their
own, compiled as one graph each, and the table, the profile's differences and the JSON agree."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_host_overhead
from fp8shard.models import GPTConfig
from fp8shard.nn.gemm_filter import fp8_gemm_pays
from fp8shard.train.config import load_config


def test_both_arms_run_compiled_and_report_every_phase(tmp_path, capsys):
    out = tmp_path / "host.json"
    result = bench_host_overhead.main(["--layers", "2", "--width", "16", "--seq", "8", "--reps", "3",
                                       "--warmup", "1", "--micro-batches", "2", "--rounds", "2",
                                       "--backend", "aot_eager", "--profile", "--profile-reps", "2",
                                       "--top", "5", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    arms = result["arms"]
    assert set(arms) == {"bf16", "fp8"}
    # the FP8 arm stores the block projections in FP8 (4 per block), the bf16 arm none
    assert (arms["fp8"]["fp8_weights"], arms["bf16"]["fp8_weights"]) == (8, 0)
    assert arms["fp8"]["params"] == arms["bf16"]["params"]
    for arm in arms.values():
        assert arm["rounds"] == 2
        assert arm["graphs"] == 1 and arm["compile_scope"] == "graph"  # the command's whole-model graph
        assert set(arm["phases"]) == set(bench_host_overhead.PHASES)
        assert all(p["host_ms"] > 0 for p in arm["phases"].values())
        assert arm["phases"]["step"]["host_ms"] == arm["phases"]["step"]["wall_ms"]  # no device apart
        assert arm["phases"]["forward"]["wall_ms"] is None  # a half of a call: host time only
    assert len(result["event_diffs"]) == 5
    text = capsys.readouterr().out
    assert "fp8 / bf16" in text and "where the difference goes" in text


def test_the_gpu_arms_are_the_125m_commands():
    args = argparse.Namespace(gpu=True, threads=1, layers=12, width=16, heads=2, seq=16, micro_batch=1)
    fp8, bf16 = (bench_host_overhead.overrides(args, arm) for arm in ("fp8", "bf16"))
    # config=gpt_125m's shapes and recipe; the bf16 arm turns off FP8 compute and FP8 weights
    assert {"model.hidden_size=768", "model.encoder_seq_length=1024", "model.micro_batch_size=8",
            "model.fp8_recipe=current"} <= set(fp8)
    assert set(bf16) - set(fp8) == {"model.fp8=false", "model.fp8_params=false"}
    m = load_config(fp8, validate_cfg=False).model  # every key is one the command takes
    assert (m.num_layers, m.hidden_size, m.fp8, m.fp8_params, m.fp8_layers) == (12, 768, True, True, "auto")
    # What the arm sets by hand (every projection computing in bf16) is what fp8_layers=auto
    # picks on CUDA at these shapes
    shapes = GPTConfig(**m.shape_kwargs()).projection_shapes()
    assert len(shapes) == 4 and not any(fp8_gemm_pays(i, o) for o, i in shapes.values())

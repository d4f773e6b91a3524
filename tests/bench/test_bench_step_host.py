"""benchmarks/bench_step_host.py on the CPU: the 125M command's parameter list split as the 125M
model's buffers are, the fused step's kernels stubbed and counted, the step's host work reported;
the stub is taken away afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_step_host


def test_the_step_is_timed_counted_and_profiled(tmp_path, capsys):
    from fp8shard.optim import triton_adam

    real = triton_adam.launch_adam
    out = tmp_path / "step.json"
    res = bench_step_host.main(["--reps", "3", "--rounds", "1", "--top", "5",
                                "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert triton_adam.launch_adam is real
    # the 125M GPT's tensors, its FP8 weights, and its buffers' split (tests/train pins the preset)
    assert (res["params"], res["fp8_weights"], res["buckets"], res["regions"]) == (148, 48, 11, 2)
    assert res["step_kernel"] == "FusedKernel" and res["fp8_scales"] == 48
    # kernel 1 on each region (the FP8 one and the other, one param group with weight decay and
    # one without in the other) and kernel 2's cast: the stub saw the fused step's launches
    assert res["kernel_launches_stubbed"] >= 3
    assert res["host_ms"] > 0 and res["python_calls"] > 0 and res["torch_ops"] > 0
    assert len(res["top"]) == 5 and res["top"][0]["function"].startswith("optim/")
    assert "Python calls" in capsys.readouterr().out


def test_a_tiled_recipe_takes_the_reference_kernel_and_nothing_is_stubbed():
    res = bench_step_host.main(["--recipe", "blockwise", "--reps", "2", "--rounds", "1", "--top", "3"])
    assert res["step_kernel"] == "FlatReferenceKernel" and res["kernel_launches_stubbed"] == 0
    assert res["fp8_weights"] == 48 and res["fp8_scales"] > 48  # a scale per 128x128 block
    assert res["torch_ops"] > 0


@pytest.mark.gpu
def test_gpu_mode_times_the_step_beside_torch_adamw():
    res = bench_step_host.main(["--gpu", "--reps", "3"])
    assert (res["params"], res["fp8_weights"]) == (148, 48)
    for name in ("fp8shard", "adamw_fused"):
        assert 0 < res[name]["host_ms"] <= res[name]["wall_ms"] * 1.05, name

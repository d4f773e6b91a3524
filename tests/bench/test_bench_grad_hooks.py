"""benchmarks/bench_grad_hooks.py on the CPU: both arms time one backward of the same parameters;
the engine arm really goes through the flat engine's hooks (its gradients land in the bucket)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_grad_hooks


def test_both_arms_time_the_backward(tmp_path, capsys):
    out = tmp_path / "hooks.json"
    result = bench_grad_hooks.main(["--params", "6", "--numel", "32", "--reps", "8", "--rounds", "1",
                                    "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    ms = result["backward_host_ms"]
    assert ms["autograd"] > 0 and ms["engine"] > 0
    assert result["engine_extra_us_per_param"] == (ms["engine"] - ms["autograd"]) / 6 * 1e3
    assert "engine extra per parameter" in capsys.readouterr().out


def test_the_engine_arm_fills_the_bucket():
    """The arm measures the hooks: after its backwards the parameters hold no ``.grad`` and the
    bucket holds their sum."""
    import torch

    from fp8shard.optim import DistributedFusedAdam

    params = [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)) for _ in range(3)]
    opt = DistributedFusedAdam(params, lr=1e-3)
    with opt.no_sync():
        bench_grad_hooks._backward_ms(params, 2, "cpu")
    assert all(p.grad is None for p in params)
    (rb,) = opt.engine.regions
    for i in range(3):
        assert torch.equal(rb.grad_slot(i).float(), torch.full((4,), 2.0)), i

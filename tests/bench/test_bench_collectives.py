"""benchmarks/bench_collectives.py on 2 gloo ranks at tiny sizes: it runs under torchrun, prints
its table, and its JSON has every size and collective, with the FP8 all-gather moving half the
bytes of the bf16 one and bandwidths consistent with the times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_collectives_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "collectives.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "bench_collectives.py"), "--sizes-m", "0.01,0.1001",
           "--warmup", "1", "--reps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "AG fp8 ms" in proc.stdout and "world size 2 (gloo)" in proc.stdout
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["backend"] == "gloo"
    assert [r["elements"] for r in res["rows"]] == [10000, 100100]  # padded to a multiple of 2
    for r in res["rows"]:
        n = r["elements"]
        fp8, bf16, rs = r["all_gather_fp8"], r["all_gather_bf16"], r["reduce_scatter_bf16"]
        assert (fp8["bytes"], bf16["bytes"], rs["bytes"]) == (n, 2 * n, 2 * n)
        for c in (fp8, bf16, rs):
            assert c["ms"] > 0
            assert abs(c["algbw_GBps"] - c["bytes"] / (c["ms"] / 1e3) / 1e9) <= 1e-6 * c["algbw_GBps"]
            assert abs(c["busbw_GBps"] - c["algbw_GBps"] / 2) <= 1e-9 * c["algbw_GBps"] + 1e-12
        assert abs(r["fp8_over_bf16_time"] - fp8["ms"] / bf16["ms"]) < 1e-9


def test_bench_collectives_refuses_to_run_without_torchrun():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_collectives.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "launch with torchrun" in proc.stderr

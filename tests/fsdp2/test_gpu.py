"""The FSDP2 engine on CUDA (NCCL, one GPU per rank): the GPU twin of test_engine.py.

Both engines run the fused Triton step there for per-tensor weights (FSDP2Adam's
FSDP2FusedKernel); tiled weights take FSDP2Kernel, torch's fused AdamW kernel. The two agree
with the reference formulas to rounding, not bit for bit: the losses are compared to 1%.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import pools_fixture
from tests.fsdp2 import cases

dist_pools = pools_fixture("nccl")


def _ranks() -> int:
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, "rowwise", "blockwise"])
def test_losses_match_flat_engine_on_gpu(dist_pools, recipe):
    """Per-tensor, rowwise and blockwise FP8 weights (the tiled ones' scale rows gathered with
    the bytes, their tiles cast locally; test_tiled.py on gloo) train as on the flat engine."""
    pool = dist_pools(_ranks())
    flat = pool.run(cases.run_losses, "flat", 10, recipe=recipe)[0]
    fsdp2 = pool.run(cases.run_losses, "fsdp2", 10, recipe=recipe)[0]
    assert fsdp2[-1] < fsdp2[0] - 1.0
    assert fsdp2 == pytest.approx(flat, rel=1e-2)


@pytest.mark.gpu
def test_all_gather_moves_fp8_bytes_on_nccl(dist_pools):
    # At world size 1 FSDP2 (torch 2.11) gathers nothing: the wire needs two GPUs.
    if _ranks() < 2:
        pytest.skip("needs 2 GPUs (FSDP2 does not gather at world size 1): "
                    "bash benchmarks/run_multi_gpu.sh tests")
    r = dist_pools(_ranks()).run(cases.wire_bytes)[0]
    assert r["keys"][0] == "all_gather.params.uint8"
    assert r["bytes_per_elem_per_step"] == pytest.approx(1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_fused_step_kernel_on_gpu(dist_pools, scaling):
    """On CUDA, 'auto' picks the fused Triton step for per-tensor weights (and the reference
    kernel for rowwise ones); it trains as the reference kernel does (test_engine.py checks
    the same orchestration bit for bit on gloo with the PyTorch tile ops)."""
    pool = dist_pools(_ranks())
    assert pool.run(cases.step_kernel_name, "fsdp2")[0] == "FSDP2FusedKernel"
    assert pool.run(cases.step_kernel_name, "fsdp2", "rowwise")[0] == "FSDP2Kernel"
    ref = pool.run(cases.run_losses, "fsdp2/reference", 10, scaling=scaling)[0]
    fused = pool.run(cases.run_losses, "fsdp2/fused", 10, scaling=scaling)[0]
    assert fused[-1] < fused[0] - 1.0
    assert fused == pytest.approx(ref, rel=1e-2)

"""``FSDP2FusedKernel`` with its Triton kernels run by Triton's interpreter on the CPU
(``tests/triton_interp.py``): the path ``step_kernel='auto'`` takes on a GPU, end to end in one
process (a 1-rank gloo group, FSDP2 on the CPU), against the PyTorch-ops reference kernel.

What this adds to test_engine.py (the same orchestration with the PyTorch tile ops, bit for bit)
is the Triton kernels themselves on FSDP2's local shards: per-parameter tile tables, the bf16
gradient views, the uint8 views of the local FP8 bytes, the tile amaxes in one buffer. The
interpreted kernels follow the CUDA foreach kernels' op order, not the CPU's, so the comparison
has the tolerance of the flat engine's twin (tests/optim/test_fused_step_interpreted.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fp8shard
from fp8shard.fp8 import Float8Tensor
from fp8shard.optim import fsdp2, fused_step
from fp8shard.optim.fsdp2 import local_shard
from tests.fsdp2 import cases


@pytest.fixture
def one_rank_group(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def interpreted(monkeypatch):
    from fp8shard._triton import triton_enabled
    from fp8shard.optim import triton_adam
    from tests.triton_interp import interpreted as interpreted_kernels

    with interpreted_kernels(monkeypatch, triton_adam):
        for mod in (fused_step, fsdp2):
            monkeypatch.setattr(mod, "use_triton", lambda *tensors: triton_enabled())
        fp8shard.set_triton(True)
        try:
            yield
        finally:
            fp8shard.set_triton(None)


def _train(kernel: str, steps: int, scaling: str):
    cases.pin_gemm()
    torch.manual_seed(0)
    model = cases.make_model()
    cases.shard(model)
    opt = cases.make_opt(model, f"fsdp2/{kernel}", scaling=scaling)
    losses = cases.train_steps(model, opt, range(steps))
    return model, opt, losses


def _assert_states_close(opt, ref_opt, model, ref_model) -> None:
    """The tolerance of the flat engine's interpreted twin (``assert_optimizers_close``)."""
    for name in ("master", "exp_avg", "exp_avg_sq"):
        for x, y in zip(getattr(opt.engine, name), getattr(ref_opt.engine, name), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))
    fp8 = 0
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        a, b = local_shard(p), local_shard(q)
        if isinstance(a, Float8Tensor):
            fp8 += 1
            torch.testing.assert_close(a._scale_inv, b._scale_inv, rtol=1e-6, atol=0)
            diff = (a.uint8_view().int() - b.uint8_view().int()).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-2
        else:
            torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=2**-7, atol=1e-6)
    assert fp8 > 0


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_interpreted_fused_kernel_trains_as_the_reference_kernel(one_rank_group, interpreted, scaling):
    """After one step the states agree to rounding and the FP8 bytes to one code in under 1% of
    the weights; such a flipped byte changes the next forward, so over the next steps only the
    losses are compared (to 0.1%)."""
    ref_model, ref_opt, ref_losses = _train("reference", 1, scaling)
    model, opt, losses = _train("auto", 1, scaling)  # 'auto' picks it where Triton serves
    kernel = opt.engine.kernel
    assert type(kernel).__name__ == "FSDP2FusedKernel" and kernel.triton
    assert type(ref_opt.engine.kernel).__name__ == "FSDP2Kernel"
    _assert_states_close(opt, ref_opt, model, ref_model)
    losses += cases.train_steps(model, opt, range(1, 4))
    ref_losses += cases.train_steps(ref_model, ref_opt, range(1, 4))
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(ref_losses, rel=1e-3)

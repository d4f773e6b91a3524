"""[Note: skip on the device] (optim/core.py): the fused step takes its skip decision on the device.

On the CPU the fused kernel's reference ops stand in for the Triton kernels (which read the flag
themselves: ``test_fused_step_interpreted.py`` runs them interpreted, ``-m gpu`` compiled). The
same optimizer with ``FusedKernel.decides_on_device`` switched off takes the decision on the
host first, as every other kernel does: the two must agree bit for bit, every skipped step must
leave every byte as it was, and the fused step must not read the decision inside ``step()``.
"""

from __future__ import annotations

import pytest
import torch

from fp8shard.fp8 import Float8Tensor
from fp8shard.optim import DistributedFusedAdam, core
from fp8shard.optim.fused_step import FusedKernel
from tests.optim.test_fused_step_optimizer import _backward, _opt_params

NAN_STEP, NO_GRAD_STEP = 3, 5


def _state(params, opt: DistributedFusedAdam) -> list[torch.Tensor]:
    """Every tensor a step may change: master, moments, the parameters' bytes and scales, the
    weight scales and any amax history (cloned)."""
    out = []
    for rb in opt.engine.regions:
        out += [rb.master, rb.exp_avg, rb.exp_avg_sq, rb.param_buffer]
    for p in params:
        out += [p._data.view(torch.uint8), p._scale_inv] if isinstance(p, Float8Tensor) else [p.detach()]
    fp8 = opt.engine.fp8
    out.append(fp8.scale)
    for g in fp8.groups:
        hist = getattr(g.quantizer, "history", None)
        if hist is not None:
            out += [hist.history, hist.scale]
    return [t.clone() for t in out]


def _train(monkeypatch, on_device: bool, scaling: str, steps: int = 6):
    monkeypatch.setattr(FusedKernel, "decides_on_device", on_device)
    params = _opt_params(0, "cpu")
    groups = [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0, "lr": 3e-3}]
    opt = DistributedFusedAdam(groups, lr=1e-2, weight_decay=0.1, bucket_cap_mb=20000 * 2 / 2**20,
                               fp8_weight_scaling=scaling, step_kernel="fused")
    assert isinstance(opt.engine.kernel, FusedKernel)
    states = []
    for step in range(1, steps + 1):
        if step != NO_GRAD_STEP:
            _backward(params, step, "cpu", nan=step == NAN_STEP)
        opt.clip_grad_norm(0.5)
        before = _state(params, opt)
        opt.step()
        after = _state(params, opt)
        assert opt.last_step_skipped == (step in (NAN_STEP, NO_GRAD_STEP))
        if opt.last_step_skipped:  # nothing moved, not one byte
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        else:
            assert not all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        states.append(after)
        opt.zero_grad()
    return states, opt


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_a_step_decided_on_the_device_is_the_step_decided_on_the_host(monkeypatch, scaling):
    """Six steps, a NaN gradient at step 3 and no gradient at step 5: with the decision on the
    device and on the host, every tensor after every step is the same, bit for bit, and both count
    four steps (the bias correction of steps 4 and 6 uses t = 3 and 4)."""
    on_device, opt_d = _train(monkeypatch, True, scaling)
    on_host, opt_h = _train(monkeypatch, False, scaling)
    assert opt_d.state_dict()["step"] == opt_h.state_dict()["step"] == 4
    for step, (a, b) in enumerate(zip(on_device, on_host, strict=True), 1):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"step {step}"


def test_the_fused_step_reads_its_decision_after_the_step(monkeypatch):
    """``step()`` with the fused kernel never reads the statistics on the host (on CUDA that
    read waits for the backward); ``last_step_skipped`` (or the next ``step()``) does. With the
    decision on the host, ``step()`` reads it itself."""
    reads: list[int] = []
    real = core._host_stats
    monkeypatch.setattr(core, "_host_stats", lambda grads: reads.append(1) or real(grads))
    for on_device in (True, False):
        monkeypatch.setattr(FusedKernel, "decides_on_device", on_device)
        params = _opt_params(0, "cpu")
        opt = DistributedFusedAdam(params, lr=1e-2, step_kernel="fused")
        _backward(params, 1, "cpu")
        opt.clip_grad_norm(1.0)
        reads.clear()
        opt.step()
        assert len(reads) == (0 if on_device else 1)
        assert opt.last_step_skipped is False
        assert len(reads) == 1
        _backward(params, 2, "cpu")
        opt.step()  # settles nothing more: the first step was read above
        assert opt._step == 2


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_the_fused_step_does_not_wait_for_the_gpu(scaling):
    """On CUDA with the Triton kernels, ``clip_grad_norm`` and ``step()`` make no host sync (any
    would raise under ``set_sync_debug_mode('error')``); the decision is read afterwards. A NaN
    step is still skipped."""
    params = _opt_params(0, "cuda")
    opt = DistributedFusedAdam(params, lr=1e-2, fp8_weight_scaling=scaling)
    assert isinstance(opt.engine.kernel, FusedKernel) and opt.engine.kernel.triton
    for step in range(1, 5):
        _backward(params, step, "cuda", nan=step == 4)
        if step >= 3:  # after the first steps' one-time set-up (index tables moved to the GPU)
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.clip_grad_norm(1.0)
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert opt.last_step_skipped == (step == 4)
        opt.zero_grad()
    assert opt.state_dict()["step"] == 3

"""``DistributedFusedAdam`` trained with ``fp8shard.set_triton(True)`` against ``set_triton(False)``
(PyTorch's fused Adam kernel + the cast chain) to a stated tolerance, on the GPU (``-m gpu``);
``test_fused_step_interpreted.py`` runs the same comparison on the CPU under Triton's
interpreter. The kernels one by one: ``test_fused_step.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8shard
from fp8shard.fp8 import Float8Tensor, Fp8Format
from fp8shard.optim import DistributedFusedAdam


def _opt_params(seed: int, device: str) -> list[nn.Parameter]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device) * 0.05

    out = []
    for shape, fmt in (((300, 77), Fp8Format.E4M3), ((64, 64), Fp8Format.E4M3), ((129, 33), Fp8Format.E5M2),
                       ((2048, 16), Fp8Format.E4M3)):
        w = rnd(*shape)
        p = nn.Parameter(Float8Tensor.quantize(w, fmt))
        p.set_high_precision_init_val(w)
        out.append(p)
    out.append(nn.Parameter(rnd(1000).to(torch.bfloat16)))
    out.append(nn.Parameter(rnd(33)))
    return out


def _backward(params: list[nn.Parameter], step: int, device: str, nan: bool = False) -> None:
    gen = torch.Generator(device=device).manual_seed(100 + step)
    loss = sum((p.float() * torch.randn(p.shape, generator=gen, device=device)).sum() for p in params)
    (loss * (float("nan") if nan else 1e-2)).backward()


def _run_opt(triton: str, steps: int, scaling: str, state_dtype: torch.dtype,
             clip: float | None, device: str = "cuda") -> tuple[list[nn.Parameter], DistributedFusedAdam]:
    fp8shard.set_triton(triton == "1")  # the optimizer's fused step is on by default (fused=True)
    params = _opt_params(0, device)
    groups = [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0, "lr": 3e-3}]
    opt = DistributedFusedAdam(groups, lr=1e-2, weight_decay=0.1, bucket_cap_mb=20000 * 2 / 2**20,
                               state_dtype=state_dtype, fp8_weight_scaling=scaling)
    for step in range(1, steps + 1):
        _backward(params, step, device, nan=step == 3)
        if clip is not None:
            opt.clip_grad_norm(clip)
        opt.step()
        assert opt.last_step_skipped == (step == 3)
        opt.zero_grad()
    assert (opt._fused is not None) == (triton == "1")
    return params, opt


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_optimizer_with_triton_matches_without(scaling, state_dtype):
    """``set_triton(True)`` vs ``False`` (PyTorch's fused Adam kernel with fp32 states, the foreach chain with
    bf16 states, then the amax / cast chain), 6 steps, one skipped, clipping on; the gradients do
    not depend on the weights, so differences do not feed back. Tolerance: fp32 states, master and
    states within rtol 1e-5 and 1e-5 of the tensor's largest magnitude (a few ulps between two
    Adam formulas, over 5 steps); bf16 states, within 2**-6 and 2**-8 of the largest (one bf16
    rounding going the other way), master within 4 * lr * 2**-8 (what such a flip moves an update);
    FP8 bytes within one code of each other (< 1% of them); scales rtol 1e-6."""
    pa, oa = _run_opt("1", 6, scaling, state_dtype, clip=0.5)
    pb, ob = _run_opt("0", 6, scaling, state_dtype, clip=0.5)
    assert oa.state_dict()["step"] == ob.state_dict()["step"] == 5
    assert_optimizers_close(pa, oa, pb, ob, state_dtype, lr=1e-2)


def assert_optimizers_close(pa: list[nn.Parameter], oa: DistributedFusedAdam, pb: list[nn.Parameter],
                            ob: DistributedFusedAdam, state_dtype: torch.dtype, lr: float) -> None:
    """The tolerance of ``test_optimizer_with_triton_matches_without`` (its docstring)."""
    sa, sb = oa.state_dict(), ob.state_dict()
    for i in sa["state"]:
        for k in ("master", "exp_avg", "exp_avg_sq"):
            x, y = sa["state"][i][k].float(), sb["state"][i][k].float()
            big = float(y.abs().max())
            if state_dtype == torch.float32:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * big)
            elif k == "master":
                torch.testing.assert_close(x, y, rtol=1e-5, atol=4 * lr * 2**-8)
            else:
                torch.testing.assert_close(x, y, rtol=2**-6, atol=2**-8 * big)
    for p, q in zip(pa, pb, strict=True):
        if isinstance(p, Float8Tensor):
            torch.testing.assert_close(p._scale_inv, q._scale_inv, rtol=1e-6, atol=0)
            diff = (p.uint8_view().int() - q.uint8_view().int()).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-2
        else:
            torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=2**-7, atol=1e-6)

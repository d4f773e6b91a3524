"""Delayed scaling without an uninformed first step ([Note: informed first call] in nn/linear.py):
a layer with an empty amax history casts as current scaling and records those amaxes; later
calls use the history; a loaded history is not treated as empty."""

from __future__ import annotations

import io

import pytest
import torch

import fp8shard as fs
from fp8shard.nn import Linear
from fp8shard.testing import sqnr_db
from tests.nn._cases import fwd_bwd

FMT_MAX = torch.tensor([448.0, 448.0, 57344.0])  # input, weight (E4M3), output gradient (E5M2)
DELAYED = fs.DelayedScaling(amax_history_len=4)


def _pair(device: str, fp8_params: bool) -> tuple[Linear, Linear]:
    """Two layers with the same values on ``device``."""
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        with fs.fp8_model_init(enabled=fp8_params):
            layers.append(Linear(64, 96, device=device))
    return layers[0], layers[1]


def _data(device: str, seed: int, x_gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=gen) * 40 * x_gain  # amax far from 448: scale 1 loses bits
    dy = torch.randn(32, 96, generator=gen) * 1e-3  # E5M2 at scale 1 flushes much of it
    return x.to(device), dy.to(device)


def first_call_case(device: str, fp8_params: bool) -> None:
    delayed, current = _pair(device, fp8_params)
    x, dy = _data(device, 1)
    want = fwd_bwd(current, x, dy, fs.CurrentScaling())
    got = fwd_bwd(delayed, x, dy, DELAYED)
    for name, a, b in zip(("y", "dx", "dW", "dbias"), got, want, strict=True):
        assert torch.equal(a, b), f"{name}: the first delayed call is not current scaling's"
    ref = x.double() @ (delayed.weight.dequantize() if fp8_params else delayed.weight).detach().double().t()
    assert sqnr_db(ref + delayed.bias.detach().double(), got[0]) == sqnr_db(
        ref + current.bias.detach().double(), want[0])
    # the history holds what the call saw (row 0), the scales wait for the update
    w_amax = 0.0 if fp8_params else delayed.weight.detach().abs().max().item()  # FP8 weight: own scale
    seen = torch.tensor([x.abs().max().item(), w_amax, dy.abs().max().item()])
    torch.testing.assert_close(delayed.fp8_amax_history[0].cpu(), seen, rtol=0, atol=0)
    assert torch.equal(delayed.fp8_scale.cpu(), torch.ones(3))
    delayed.update_fp8_scales()
    expected = torch.where(seen > 0, FMT_MAX / seen, torch.ones(3))
    torch.testing.assert_close(delayed.fp8_scale.cpu(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp_weight", "fp8_weight"])
def test_first_delayed_call_is_current_scaling(fp8_params):
    first_call_case("cpu", fp8_params)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp_weight", "fp8_weight"])
def test_first_delayed_call_is_current_scaling_cuda(fp8_params):
    first_call_case("cuda", fp8_params)


def test_later_calls_use_the_history():
    """After the first call the cast uses the history's scales: a tensor 4x larger than the
    window saturates (current scaling would rescale and not saturate)."""
    delayed, current = _pair("cpu", False)
    fwd_bwd(delayed, *_data("cpu", 1), DELAYED)
    delayed.update_fp8_scales()
    scale_x = delayed.fp8_scale[0].clone()
    x, dy = _data("cpu", 2, x_gain=4.0)
    y = fwd_bwd(delayed, x, dy, DELAYED)[0]
    assert not torch.equal(y, fwd_bwd(current, x, dy, fs.CurrentScaling())[0])
    xq = fs.Float8Tensor.quantize(x, scale=scale_x).dequantize()
    wq = fs.Float8Tensor.quantize(delayed.weight.detach(), scale=delayed.fp8_scale[1]).dequantize()
    torch.testing.assert_close(y, xq @ wq.t() + delayed.bias.detach(), rtol=1e-5, atol=1e-4)
    assert (xq.abs() == 448.0 / scale_x).any()  # saturated, as the history's scale says


def _round_trip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_loaded_history_is_not_treated_as_empty():
    trained, _ = _pair("cpu", False)
    for seed in (1, 2):
        fwd_bwd(trained, *_data("cpu", seed), DELAYED)
        trained.update_fp8_scales()
    torch.manual_seed(5)
    fresh = Linear(64, 96)
    fresh.load_state_dict(_round_trip(trained.state_dict()))
    # the fresh layer's first call uses the loaded scales, exactly as the trained layer's next one
    x, dy = _data("cpu", 3, x_gain=4.0)
    a, b = fwd_bwd(trained, x, dy, DELAYED), fwd_bwd(fresh, x, dy, DELAYED)
    for t, u in zip(a, b, strict=True):
        assert torch.equal(t, u)
    torch.manual_seed(5)
    uninformed = Linear(64, 96)
    uninformed.load_state_dict(trained.state_dict())
    current = fwd_bwd(uninformed, x, dy, fs.CurrentScaling())[0]
    assert not torch.equal(b[0], current)  # ... and not as current scaling


def test_saved_empty_history_stays_empty_and_dropped_state_starts_over():
    prepared, reference = _pair("cpu", False)
    fs.nn.prepare_delayed_scaling(prepared, DELAYED)  # state made, nothing recorded yet
    torch.manual_seed(5)
    loaded = Linear(64, 96)
    loaded.load_state_dict(_round_trip(prepared.state_dict()))
    x, dy = _data("cpu", 1)
    want = fwd_bwd(reference, x, dy, fs.CurrentScaling())
    assert torch.equal(fwd_bwd(loaded, x, dy, DELAYED)[0], want[0])  # still a first call
    loaded.update_fp8_scales()
    # a high-precision state dict drops the delayed-scaling state (its amaxes were of other
    # weights): the next call is a first call again
    loaded.load_state_dict(torch.nn.Linear(64, 96).state_dict())
    got = fwd_bwd(loaded, x, dy, DELAYED)[0]
    loaded_current = fwd_bwd(loaded, x, dy, fs.CurrentScaling())[0]
    assert torch.equal(got, loaded_current)

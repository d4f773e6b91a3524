"""State dicts of FP8 layers: a bit-exact round trip (bytes, scales, delayed-scaling state) and
high-precision checkpoints quantized on load."""

from __future__ import annotations

import io

import pytest
import torch

import fp8shard as fs
from fp8shard.nn import Linear
from tests.nn._cases import fwd_bwd


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    with fs.fp8_model_init():
        return torch.nn.Sequential(Linear(32, 64), torch.nn.LayerNorm(64), Linear(64, 16))


def _train(model: torch.nn.Module, steps: int, recipe: object, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    sync = fs.nn.AmaxSync(model)
    for _ in range(steps):
        y = fwd_bwd(model, torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen), recipe)[0]
        sync.step()
    return y


def test_fp8_state_dict_round_trip_is_bit_exact():
    recipe = fs.DelayedScaling(amax_history_len=5)
    model = _model(0)
    _train(model, 3, recipe, seed=1)
    with torch.no_grad():  # a scale other than the init one, as after an optimizer step
        model[0].weight.quantize_(torch.randn(64, 32) * 0.1)
    sd = model.state_dict()
    assert set(sd) == {"0.weight", "0.bias", "0.fp8_amax_history", "0.fp8_scale", "1.weight", "1.bias",
                       "2.weight", "2.bias", "2.fp8_amax_history", "2.fp8_scale"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded_sd = torch.load(buf, weights_only=True)
    fresh = _model(123)
    fresh.load_state_dict(loaded_sd)
    for key, value in model.state_dict().items():
        got = fresh.state_dict()[key]
        assert type(got) is type(value), key
        if isinstance(value, fs.Float8Tensor):
            assert torch.equal(got.uint8_view(), value.uint8_view()), key
            assert torch.equal(got.scale_inv, value.scale_inv), key
            assert got.dtype == value.dtype and got.fp8_format is value.fp8_format
        else:
            assert torch.equal(got, value), key
    # the loaded model continues exactly like the original: same scales, same outputs
    y_a = _train(model, 2, recipe, seed=7)
    y_b = _train(fresh, 2, recipe, seed=7)
    assert torch.equal(y_a, y_b)
    assert torch.equal(model[0].fp8_amax_history, fresh[0].fp8_amax_history)


def test_state_dict_keys_match_nn_linear_until_delayed_scaling_is_used():
    torch.manual_seed(0)
    layer, ref = Linear(8, 4), torch.nn.Linear(8, 4)
    assert list(layer.state_dict()) == list(ref.state_dict())
    fwd_bwd(layer, torch.randn(2, 8), torch.randn(2, 4), fs.CurrentScaling())
    assert list(layer.state_dict()) == list(ref.state_dict())


def test_loading_a_high_precision_state_dict_quantizes():
    torch.manual_seed(0)
    hp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16))
    model = _model(5)
    _train(model, 1, fs.DelayedScaling(), seed=0)  # has delayed-scaling state now
    model.load_state_dict(hp.state_dict())  # strict: the nn.Linear keys are all it needs
    for i in (0, 2):
        w = model[i].weight
        assert isinstance(w, fs.Float8Tensor) and w.fp8_data.element_size() == 1
        expected = fs.Float8Tensor.quantize(hp[i].weight.detach())  # scale from the amax
        assert torch.equal(w.uint8_view(), expected.uint8_view())
        assert torch.equal(w.scale_inv, expected.scale_inv)
        assert torch.equal(model[i].bias, hp[i].bias)
        # the amaxes of the old weights would give bogus scales: the state starts over
        assert not hasattr(model[i], "fp8_amax_history")


def test_loading_fp8_state_dict_into_high_precision_layer_dequantizes():
    model = _model(0)
    hp = torch.nn.Sequential(Linear(32, 64), torch.nn.LayerNorm(64), Linear(64, 16))
    hp.load_state_dict(model.state_dict())
    assert not isinstance(hp[0].weight, fs.Float8Tensor)
    assert torch.equal(hp[0].weight, model[0].weight.dequantize())


def test_mismatched_fp8_weight_shape_is_a_clear_error():
    model = _model(0)
    wrong = fs.Float8Tensor.quantize(torch.randn(16, 32))
    with pytest.raises(ValueError, match=r"shape \(16, 32\).*\(64, 32\).*Linear\(32, 16\)"):
        model[0].load_state_dict({"weight": wrong, "bias": torch.zeros(64)})

"""Serialization round trips are bit-exact; loading high precision into FP8 quantizes."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import fp8shard as fs


def _roundtrip(obj, weights_only=True):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


@pytest.mark.parametrize("fmt", [fs.Fp8Format.E4M3, fs.Fp8Format.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_save_load_weights_only_is_bit_exact(fmt, dtype):
    t = fs.Float8Tensor.quantize(torch.randn(5, 7).to(dtype), fmt)
    back = _roundtrip({"w": t})["w"]
    assert isinstance(back, fs.Float8Tensor)
    assert back.dtype == dtype and back.fp8_format is fmt
    assert torch.equal(back.uint8_view(), t.uint8_view())
    assert torch.equal(back.scale_inv, t.scale_inv)


def test_pickle_round_trip():
    t = fs.Float8Tensor.quantize(torch.randn(3, 3))
    back = pickle.loads(pickle.dumps(t))
    assert torch.equal(back.uint8_view(), t.uint8_view()) and torch.equal(back.scale_inv, t.scale_inv)


def _fp8_linear(seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(12, 8)
    lin.weight = torch.nn.Parameter(fs.Float8Tensor.quantize(lin.weight.detach()))
    return lin


def test_module_state_dict_round_trip_is_bit_exact():
    src, dst = _fp8_linear(0), _fp8_linear(1)
    sd = _roundtrip(src.state_dict())
    dst.load_state_dict(sd)
    assert isinstance(dst.weight, fs.Float8Tensor)
    assert torch.equal(dst.weight.uint8_view(), src.weight.uint8_view())
    assert torch.equal(dst.weight.scale_inv, src.weight.scale_inv)
    assert torch.equal(dst.bias, src.bias)


def test_loading_a_high_precision_state_dict_quantizes():
    dst = _fp8_linear()
    ptr = dst.weight.fp8_data.data_ptr()
    w = torch.randn(8, 12) * 5
    dst.load_state_dict({"weight": w, "bias": torch.zeros(8)})
    assert isinstance(dst.weight, fs.Float8Tensor) and dst.weight.fp8_data.data_ptr() == ptr
    expected = fs.Float8Tensor.quantize(w)
    assert torch.equal(dst.weight.uint8_view(), expected.uint8_view())
    assert torch.equal(dst.weight.scale_inv, expected.scale_inv)


def test_loading_a_state_dict_of_the_wrong_shape_names_the_key():
    dst = _fp8_linear()
    with pytest.raises(RuntimeError, match="weight"):
        dst.load_state_dict({"weight": torch.randn(3, 3), "bias": torch.zeros(8)})

"""Quantization numerics: bit-exact casts, error bounds, saturation, zeros, NaN and inf."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fp8shard as fs
from tests.fp8.reference import reference_cast

FORMATS = [fs.Fp8Format.E4M3, fs.Fp8Format.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (17, 33), (2, 3, 129), (0, 4)]


def _random(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # log-uniform magnitudes over many binades, random signs: exercises subnormals and ties
    mag = torch.exp(torch.empty(shape).uniform_(-12, 6, generator=g))
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(dtype).to(device)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_is_bit_exact_with_torch_cast(fmt, dtype, shape, device="cpu"):
    x = _random(shape, dtype, seed=hash((fmt.value, str(dtype), shape)) % 2**31, device=device)
    scale = torch.tensor(37.5, device=device)
    t = fs.Float8Tensor.quantize(x, fmt, scale=scale)
    expected = (x.float() * scale).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)
    assert t.shape == x.shape and t.dtype == x.dtype
    assert t.fp8_data.dtype == fmt.torch_dtype
    assert torch.equal(t.uint8_view(), expected.view(torch.uint8))
    assert t.fp8_data.untyped_storage().nbytes() == x.numel()  # one byte per element
    assert t.scale_inv.dtype == torch.float32 and t.scale_inv.dim() == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_matches_independent_round_to_nearest_even(fmt):
    values, _ = np.unique(torch.arange(128, dtype=torch.uint8).view(fmt.torch_dtype).float().numpy(),
                          return_index=True)
    values = values[np.isfinite(values)]
    mids = (values[:-1] + values[1:]) / 2  # exact ties: must round to the even code
    x = np.concatenate([values, mids, -mids, mids * (1 + 1e-6), mids * (1 - 1e-6),
                        np.random.default_rng(0).standard_normal(10_000) * 100])
    xt = torch.from_numpy(x.astype(np.float32))
    got = fs.Float8Tensor.quantize(xt, fmt, scale=1.0).dequantize().double().numpy()
    np.testing.assert_array_equal(got, reference_cast(x.astype(np.float32).astype(np.float64), fmt))


@pytest.mark.parametrize("fmt,bound,min_normal", [(fs.Fp8Format.E4M3, 2**-4, 2**-6),
                                                  (fs.Fp8Format.E5M2, 2**-3, 2**-14)])
def test_relative_error_bound_in_normal_range(fmt, bound, min_normal):
    x = _random((50_000,), torch.float32, seed=3)
    t = fs.Float8Tensor.quantize(x, fmt)  # current scaling
    scaled = (x * t.scale).abs()
    normal = (scaled >= min_normal) & (scaled <= fmt.max)
    rel = ((t.dequantize() - x).abs() / x.abs())[normal]
    assert normal.sum() > 20_000  # most of the log-uniform sample is in range
    assert rel.max().item() <= bound


@pytest.mark.parametrize("fmt", FORMATS)
def test_current_scaling_maps_amax_to_format_max(fmt):
    x = torch.tensor([0.5, -3.0, 1.25])
    t = fs.Float8Tensor.quantize(x, fmt)
    assert t.scale.item() == pytest.approx(fmt.max / 3.0)
    assert t.dequantize()[1].item() == pytest.approx(-3.0, rel=1e-6)
    assert t.fp8_data.float().abs().max().item() == fmt.max


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_inf_nan_and_signed_zero(fmt):
    x = torch.tensor([math.inf, -math.inf, 1e9, -1e9, math.nan, 0.0, -0.0, 1.0])
    t = fs.Float8Tensor.quantize(x, fmt, scale=1.0)
    d = t.dequantize()
    assert d[0].item() == fmt.max and d[1].item() == -fmt.max
    assert d[2].item() == fmt.max and d[3].item() == -fmt.max
    assert math.isnan(d[4].item())
    assert d[5].item() == 0.0 and math.copysign(1.0, d[6].item()) == -1.0
    assert d[7].item() == 1.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_and_empty_tensors_get_finite_scale(fmt):
    for x in (torch.zeros(4, 4), torch.empty(0, 3)):
        t = fs.Float8Tensor.quantize(x, fmt)
        assert torch.isfinite(t.scale_inv) and t.scale_inv.item() == 1.0
        assert torch.equal(t.dequantize(), x)


def test_dequantize_equals_bytes_times_scale_inv():
    x = _random((64, 64), torch.bfloat16, seed=5)
    t = fs.Float8Tensor.quantize(x)
    expected = (t.fp8_data.float() * t.scale_inv).to(torch.bfloat16)
    assert torch.equal(t.dequantize(), expected)
    assert t.dequantize(torch.float32).dtype == torch.float32

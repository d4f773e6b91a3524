"""Bad input gets a clear error that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch

import fp8shard as fs


def test_integer_tensor():
    with pytest.raises(TypeError, match=r"int64.*floating-point"):
        fs.Float8Tensor.quantize(torch.arange(4))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="takes a tensor"):
        fs.Float8Tensor.quantize([1.0, 2.0])


def test_unknown_format():
    with pytest.raises(ValueError, match=r"unknown FP8 format 'e3m4'.*E4M3"):
        fs.Float8Tensor.quantize(torch.randn(3), "e3m4")


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        fs.Float8Tensor.quantize(torch.randn(3), scale=scale)


def test_non_scalar_scale():
    with pytest.raises(ValueError, match="one value"):
        fs.Float8Tensor.quantize(torch.randn(3), scale=torch.ones(3))


def test_scale_on_another_device():
    scale = torch.tensor(1.0, device="meta")
    with pytest.raises(ValueError, match="move the scale"):
        fs.Float8Tensor.quantize(torch.randn(3), scale=scale)

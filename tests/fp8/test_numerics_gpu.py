"""GPU twins of the numerics tests: the same checks on CUDA tensors (run on the lent H200)."""

from __future__ import annotations

import math

import pytest
import torch

import fp8shard as fs
from tests.fp8 import test_numerics as cpu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", cpu.FORMATS)
@pytest.mark.parametrize("dtype", cpu.DTYPES)
@pytest.mark.parametrize("shape", [*cpu.SHAPES, (4096, 1031)])
def test_quantize_is_bit_exact_with_torch_cast_cuda(fmt, dtype, shape):
    cpu.test_quantize_is_bit_exact_with_torch_cast(fmt, dtype, shape, device="cuda")


@pytest.mark.parametrize("fmt", cpu.FORMATS)
def test_cuda_bytes_equal_cpu_bytes(fmt):
    x = cpu._random((513, 257), torch.bfloat16, seed=11)
    on_cpu = fs.Float8Tensor.quantize(x, fmt)
    on_gpu = fs.Float8Tensor.quantize(x.cuda(), fmt)
    assert torch.equal(on_gpu.uint8_view().cpu(), on_cpu.uint8_view())
    assert torch.equal(on_gpu.scale_inv.cpu(), on_cpu.scale_inv)


@pytest.mark.parametrize("fmt", cpu.FORMATS)
def test_saturation_and_nan_cuda(fmt):
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, 1.0], device="cuda")
    d = fs.Float8Tensor.quantize(x, fmt, scale=1.0).dequantize().cpu()
    assert d[0].item() == fmt.max and d[1].item() == -fmt.max and math.isnan(d[2].item())
    assert d[3].item() == 0.0 and d[4].item() == 1.0


def test_to_device_round_trip_keeps_bytes():
    t = fs.Float8Tensor.quantize(torch.randn(33, 17))
    g = t.to("cuda")
    assert isinstance(g, fs.Float8Tensor) and g.device.type == "cuda" and g.scale_inv.device.type == "cuda"
    assert torch.equal(g.to("cpu").uint8_view(), t.uint8_view())

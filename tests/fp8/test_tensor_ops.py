"""Float8Tensor as a tensor: which ops stay FP8, in-place semantics, autograd, modules."""

from __future__ import annotations

import copy

import pytest
import torch

import fp8shard as fs


def _f8(shape=(6, 10), dtype=torch.float32, seed=0, fmt=fs.Fp8Format.E4M3):
    g = torch.Generator().manual_seed(seed)
    return fs.Float8Tensor.quantize(torch.randn(shape, generator=g).to(dtype), fmt)


def _bytes_equal(a, b):
    return torch.equal(a.uint8_view(), b.uint8_view())


@pytest.mark.parametrize("op", [
    lambda t: t.detach(),
    lambda t: t.view(60),
    lambda t: t.reshape(3, 20),
    lambda t: t.t(),
    lambda t: t.transpose(0, 1),
    lambda t: t.unsqueeze(0),
])
def test_view_like_ops_stay_fp8_and_share_bytes_and_scale(op):
    t = _f8()
    v = op(t)
    assert isinstance(v, fs.Float8Tensor)
    assert v.fp8_data.untyped_storage().data_ptr() == t.fp8_data.untyped_storage().data_ptr()
    assert v.scale_inv is t.scale_inv
    assert torch.equal(v.dequantize(), op(t.dequantize()))


def test_clone_stays_fp8_with_its_own_bytes():
    t = _f8()
    c = t.clone()
    assert isinstance(c, fs.Float8Tensor) and _bytes_equal(c, t)
    assert c.fp8_data.data_ptr() != t.fp8_data.data_ptr() and c.scale_inv is not t.scale_inv


def test_other_ops_run_on_dequantized_values_and_return_plain_tensors():
    t = _f8()
    x = torch.randn(10, 3)
    hp = t.dequantize()
    for got, want in [(t + 1, hp + 1), (t @ x, hp @ x), (t.sum(), hp.sum()),
                      (torch.nn.functional.gelu(t), torch.nn.functional.gelu(hp)),
                      (torch.cat([t, t]), torch.cat([hp, hp]))]:
        assert type(got) is torch.Tensor
        assert torch.equal(got, want)


def test_copy_from_float8_copies_bytes_and_scale_exactly():
    dst, src = _f8(seed=1), _f8(seed=2)
    src.scale_inv.mul_(3.0)
    dst.copy_(src)
    assert _bytes_equal(dst, src) and torch.equal(dst.scale_inv, src.scale_inv)


def test_copy_from_high_precision_requantizes_with_current_scaling():
    dst = _f8()
    x = torch.randn(6, 10) * 7
    dst.copy_(x)
    expected = fs.Float8Tensor.quantize(x)
    assert _bytes_equal(dst, expected) and torch.equal(dst.scale_inv, expected.scale_inv)


def test_copy_into_plain_tensor_dequantizes():
    t = _f8()
    out = torch.empty(6, 10, dtype=torch.bfloat16)
    out.copy_(t)
    assert torch.equal(out, t.dequantize().to(torch.bfloat16))


def test_inplace_ops_dequantize_apply_requantize_in_the_same_storage():
    t = _f8()
    ptr, scale_obj = t.fp8_data.data_ptr(), t.scale_inv
    expected = fs.Float8Tensor.quantize(t.dequantize() * 0.5 + 2.0)
    t.mul_(0.5).add_(2.0)
    assert isinstance(t, fs.Float8Tensor)
    assert t.fp8_data.data_ptr() == ptr and t.scale_inv is scale_obj
    assert _bytes_equal(t, expected)
    t.zero_()  # amax 0: keep the previous scale, never inf
    assert torch.isfinite(t.scale_inv) and torch.equal(t.dequantize(), torch.zeros(6, 10))


def test_inplace_through_a_view_is_seen_by_every_wrapper():
    t = _f8()
    p = torch.nn.Parameter(t)
    with torch.no_grad():
        p.add_(1.0)
    assert _bytes_equal(p, t) and torch.equal(p.scale_inv, t.scale_inv)


def test_transpose_cache_is_reused_and_invalidated_when_bytes_change():
    t = _f8()
    first = t.fp8_transpose()
    assert first is t.fp8_transpose()  # cached
    assert torch.equal(first.view(torch.uint8), t.uint8_view().t().contiguous())
    t.copy_(torch.randn(6, 10))
    second = t.fp8_transpose()
    assert second is not first
    assert torch.equal(second.view(torch.uint8), t.uint8_view().t().contiguous())
    t.fp8_data.view(torch.uint8).fill_(3)  # written from outside: the version counter moves
    assert torch.equal(t.fp8_transpose().view(torch.uint8), t.uint8_view().t().contiguous())
    t.fp8_data.view(torch.uint8).fill_(5)
    t.mark_bytes_changed()
    assert torch.equal(t.fp8_transpose().view(torch.uint8), torch.full((10, 6), 5, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_to_device_and_dtype_keep_fp8(dtype):
    t = _f8(dtype=dtype)
    moved = t.to("cpu")
    assert isinstance(moved, fs.Float8Tensor) and _bytes_equal(moved, t)
    other = t.to(torch.float32 if dtype != torch.float32 else torch.bfloat16)
    assert isinstance(other, fs.Float8Tensor) and _bytes_equal(other, t) and other.dtype != dtype
    assert t.to(torch.int32).dtype == torch.int32


def test_parameter_in_a_module_gets_plain_gradients_of_the_nominal_dtype():
    lin = torch.nn.Linear(10, 6, bias=False, dtype=torch.bfloat16)
    lin.weight = torch.nn.Parameter(fs.Float8Tensor.quantize(lin.weight.detach()))
    assert isinstance(lin.weight, torch.nn.Parameter) and isinstance(lin.weight, fs.Float8Tensor)
    x = torch.randn(4, 10, dtype=torch.bfloat16, requires_grad=True)
    lin(x).float().pow(2).sum().backward()
    w = lin.weight.dequantize()
    y = x.detach().requires_grad_() @ w.t()
    y.float().pow(2).sum().backward()
    assert type(lin.weight.grad) is torch.Tensor and lin.weight.grad.dtype == torch.bfloat16
    assert lin.weight.grad.shape == (6, 10)
    assert torch.allclose(lin.weight.grad.float(), (2 * y.detach().float()).t().to(torch.bfloat16).float()
                          @ x.detach().float(), rtol=2e-2, atol=1e-2)


def test_deepcopy_of_a_module_keeps_fp8_parameters():
    lin = torch.nn.Linear(10, 6)
    lin.weight = torch.nn.Parameter(fs.Float8Tensor.quantize(lin.weight.detach()))
    twin = copy.deepcopy(lin)
    assert isinstance(twin.weight, fs.Float8Tensor) and isinstance(twin.weight, torch.nn.Parameter)
    assert _bytes_equal(twin.weight, lin.weight)
    assert twin.weight.fp8_data.data_ptr() != lin.weight.fp8_data.data_ptr()


def test_high_precision_init_value_is_kept_on_cpu_and_cleared():
    w = torch.randn(4, 4)
    t = fs.Float8Tensor.quantize(w)
    assert t.get_high_precision_init_val() is None
    t.set_high_precision_init_val(w)
    assert torch.equal(t.get_high_precision_init_val(), w)
    t.clear_high_precision_init_val()
    assert t.get_high_precision_init_val() is None


def test_reinit_in_place_updates_a_preserved_high_precision_value():
    t = fs.Float8Tensor.quantize(torch.zeros(8, 8) + 0.5)
    t.set_high_precision_init_val(t.dequantize())
    torch.manual_seed(0)
    torch.nn.init.normal_(t, std=0.02)  # what a model's init_weights does to an FP8 weight
    hp = t.get_high_precision_init_val()
    assert hp.std().item() == pytest.approx(0.02, rel=0.3)
    assert torch.equal(t.uint8_view(), fs.Float8Tensor.quantize(hp).uint8_view())
    w = torch.randn(8, 8)
    t.copy_(w)
    assert torch.equal(t.get_high_precision_init_val(), w)


def test_slices_are_fp8_views_that_refuse_writes_changing_the_scale():
    """[Note: FP8 slices]: t[a:b] shares the bytes and the scale; an in-place op or a copy of
    other values into it would re-scale the whole tensor, so it raises and nothing changes."""
    t = _f8()
    before = t.uint8_view().clone(), t.scale_inv.clone()
    s = t[2:4]
    assert isinstance(s, fs.Float8Tensor) and s.scale_inv is t.scale_inv
    assert torch.equal(s.dequantize(), t.dequantize()[2:4])
    assert s.fp8_data.untyped_storage().data_ptr() == t.fp8_data.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="slice of a Float8Tensor"):
        s.mul_(2)
    with pytest.raises(RuntimeError, match="slice of a Float8Tensor"):
        s.copy_(torch.ones(2, 10))
    assert torch.equal(t.uint8_view(), before[0]) and torch.equal(t.scale_inv, before[1])
    s.copy_(t[4:6])  # FP8 bytes with the same scale: exact
    assert torch.equal(t.uint8_view()[2:4], t.uint8_view()[4:6])

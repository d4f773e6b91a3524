"""FP8 Linear numerics: SQNR against float64, bit-identity with FP8-stored weights, the recipes."""

from __future__ import annotations

import pytest
import torch

import fp8shard as fs
from fp8shard.fp8.gemm import force_gemm_path, fp8_mm
from fp8shard.nn import Linear
from fp8shard.testing import sqnr_db
from tests.nn._cases import bias_epilogue_case, bit_identical_case, fwd_bwd, sqnr_case

RECIPES = {"current": fs.CurrentScaling(), "delayed": fs.DelayedScaling()}


@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp_weight", "fp8_weight"])
@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_sqnr_against_float64(recipe, fp8_params):
    sqnr = sqnr_case("cpu", fp8_params, RECIPES[recipe])
    assert sqnr["y"] >= 25 and sqnr["dx"] >= 22 and sqnr["dw"] >= 22, sqnr
    assert sqnr["y"] < 40, "suspiciously exact: are the GEMMs really in FP8?"


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp_weight", "fp8_weight"])
@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_sqnr_against_float64_cuda(recipe, fp8_params):
    sqnr = sqnr_case("cuda", fp8_params, RECIPES[recipe])
    assert sqnr["y"] >= 25 and sqnr["dx"] >= 22 and sqnr["dw"] >= 22, sqnr
    assert sqnr["y"] < 40, "suspiciously exact: are the GEMMs really in FP8?"


@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_fp8_stored_weight_is_bit_identical_to_fp8_compute(recipe):
    bit_identical_case("cpu", RECIPES[recipe])


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_fp8_stored_weight_is_bit_identical_to_fp8_compute_cuda(recipe):
    bit_identical_case("cuda", RECIPES[recipe])


def _q(x: torch.Tensor, fmt: fs.Fp8Format) -> torch.Tensor:
    """Current scaling by hand: round through FP8 with scale fmt.max / amax(x), back to fp64."""
    scale = fmt.max / x.abs().max().float()
    return (x.float() * scale).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).double() / scale.double()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_current_scaling_matches_hand_computed_reference(fmt):
    recipe = fs.CurrentScaling(fp8_format=fmt)
    bwd = fs.Fp8Format.E5M2 if fmt == "hybrid" else fs.Fp8Format.E4M3
    torch.manual_seed(0)
    layer = Linear(96, 48, bias=False)
    x, dy = torch.randn(40, 96) * 3, torch.randn(40, 48) * 1e-3
    y, dx, dw, _ = fwd_bwd(layer, x, dy, recipe)
    xq, wq, dyq = _q(x, fs.Fp8Format.E4M3), _q(layer.weight.detach(), fs.Fp8Format.E4M3), _q(dy, bwd)
    for got, ref in ((y, xq @ wq.t()), (dx, dyq @ wq), (dw, dyq.t() @ xq)):
        # fp32 accumulation of exact FP8 products: errors of ~1e-7 of the largest entry
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    # and that is a real loss of precision, not the fp32 product
    assert not torch.allclose(y, x @ layer.weight.detach().t(), rtol=1e-3, atol=1e-3)


def test_delayed_scaling_saturates_on_a_jump_where_current_scaling_does_not():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    delayed_layer, current_layer = Linear(512, 256), Linear(512, 256)
    current_layer.load_state_dict(delayed_layer.state_dict())
    delayed, current = fs.DelayedScaling(amax_history_len=8), fs.CurrentScaling()
    w64 = delayed_layer.weight.detach().double()
    sync = fs.nn.AmaxSync(delayed_layer)
    for _ in range(4):  # warm-up: the history learns amax of N(0, 1) inputs
        x, dy = torch.randn(128, 512, generator=gen), torch.randn(128, 256, generator=gen)
        fwd_bwd(delayed_layer, x, dy, delayed)
        sync.step()
    x_big = 4 * torch.randn(128, 512, generator=gen)
    ref = x_big.double() @ w64.t() + delayed_layer.bias.double()
    y_delayed = fwd_bwd(delayed_layer, x_big, dy, delayed)[0]
    # the jump is recorded (pending row 0), ~4x the amax the input's scale came from: clipped
    amax_used = fs.Fp8Format.E4M3.max / delayed_layer.fp8_scale[0]
    assert delayed_layer.fp8_amax_history[0, 0] > 3 * amax_used
    y_current = fwd_bwd(current_layer, x_big, dy, current)[0]
    sqnr_delayed, sqnr_current = sqnr_db(ref, y_delayed), sqnr_db(ref, y_current)
    assert sqnr_current >= 25
    assert sqnr_delayed < sqnr_current - 10, (sqnr_delayed, sqnr_current)
    # one step later the scale has caught up and the precision is back
    sync.step()
    x_big2 = 4 * torch.randn(128, 512, generator=gen)
    y_after = fwd_bwd(delayed_layer, x_big2, dy, delayed)[0]
    assert sqnr_db(x_big2.double() @ w64.t() + delayed_layer.bias.double(), y_after) >= 25


def test_output_dtype_follows_input_and_grad_follows_weight():
    torch.manual_seed(0)
    with fs.fp8_model_init():
        layer = Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.float32)
    y, dx, dw, _db = fwd_bwd(layer, x, torch.randn(3, 5, 32), fs.CurrentScaling())
    assert y.shape == (3, 5, 32) and y.dtype == torch.float32 and dx.dtype == torch.float32
    assert dx.shape == x.shape
    assert type(dw) is torch.Tensor and dw.dtype == torch.bfloat16 and dw.shape == (32, 64)
    xb = x.bfloat16()
    yb = fwd_bwd(layer, xb, torch.randn(3, 5, 32, dtype=torch.bfloat16), fs.CurrentScaling())[0]
    assert yb.dtype == torch.bfloat16


def test_outside_autocast_behaves_like_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(32, 16)
    torch.manual_seed(0)
    layer = Linear(32, 16)
    assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)  # same init
    x = torch.randn(8, 32)
    assert torch.equal(layer(x), ref(x))
    with fs.fp8_autocast(enabled=False):
        assert torch.equal(layer(x), ref(x))
    with fs.fp8_model_init():
        fp8_layer = Linear(32, 16)
    xi = x.clone().requires_grad_()
    y = fp8_layer(xi)  # high precision from the dequantized weight, gradients flow to it
    torch.testing.assert_close(y, x @ fp8_layer.weight.dequantize().t() + fp8_layer.bias)
    y.sum().backward()
    assert type(fp8_layer.weight.grad) is torch.Tensor
    torch.testing.assert_close(fp8_layer.weight.grad, x.sum(0).expand(16, 32))


def test_fp8_weight_transpose_is_made_once_per_change_of_bytes(monkeypatch):
    torch.manual_seed(0)
    with fs.fp8_model_init():
        layer = Linear(64, 32)
    calls = []
    original = fs.Float8Tensor.fp8_transpose

    def counting(self):
        out = original(self)
        calls.append(out.data_ptr())
        return out

    monkeypatch.setattr(fs.Float8Tensor, "fp8_transpose", counting)
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    for _ in range(2):
        fwd_bwd(layer, x, dy, fs.CurrentScaling())
    assert len(calls) == 2 and calls[0] == calls[1]  # the cached copy served the second step
    with torch.no_grad():
        layer.weight.quantize_(torch.randn(32, 64))  # the optimizer writes new bytes
    dx_new = fwd_bwd(layer, x, dy, fs.CurrentScaling())[1]
    w_new = layer.weight.dequantize()
    dyq = _q(dy, fs.Fp8Format.E5M2)
    torch.testing.assert_close(dx_new.double(), dyq @ w_new.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["padded", "emulated"])
def test_fallback_gemm_paths_match_scaled_mm(path):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, 53, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(29, 53, generator=gen).to(torch.float8_e5m2)  # [N, K] row-major
    sa, sb = torch.tensor(0.5), torch.tensor(3.0)
    with force_gemm_path("scaled_mm"):  # the CPU default may be emulated
        ref = fp8_mm(a, sa, b.t(), sb, torch.float32)
    with force_gemm_path(path):
        got = fp8_mm(a, sa, b.t(), sb, torch.float32)
    assert got.shape == (37, 29)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ref.double(), (a.double() @ b.double().t()) * 1.5, rtol=1e-6, atol=1e-5)


def test_fallback_is_reported_once(monkeypatch, recwarn):
    from fp8shard.fp8 import gemm

    monkeypatch.setattr(gemm, "_reported", set())
    monkeypatch.setattr(gemm, "_FP8_CAPABLE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    for _ in range(3):
        assert gemm.choose_gemm_path("cuda", 0, 16, 32, 48) == "emulated"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(gemm, "_FP8_CAPABLE", {})
    assert gemm.choose_gemm_path("cuda", 0, 16, 32, 48) == "scaled_mm"
    for _ in range(3):
        assert gemm.choose_gemm_path("cuda", 0, 8, 32, 48) == "padded"
    messages = [str(w.message) for w in recwarn.list if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages
    assert "emulated" in messages[0] and "padding" in messages[1]


@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp_weight", "fp8_weight"])
def test_backward_keeps_fp8_bytes_of_the_input_not_the_input(fp8_params):
    with fs.fp8_model_init(enabled=fp8_params):
        layer = Linear(64, 32, bias=False)
    x = torch.randn(48, 64, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with fs.fp8_autocast(recipe=fs.CurrentScaling()):
            y = layer(x)
    y.sum().backward()
    big = [t for t in saved if t.numel() >= 32 * 48]  # skip the 0-d scales
    # The casts write xᵀ (and Wᵀ of a high-precision weight) in the same pass, and the backward
    # keeps only those bytes ([Note: fused cast]); an FP8 weight keeps its own bytes.
    expected = [(torch.float8_e4m3fn, (64, 48))]
    if not fp8_params:
        expected.append((torch.float8_e4m3fn, (64, 32)))
    assert sorted((t.dtype, tuple(t.shape)) for t in big) == sorted(expected, key=str)
    assert all(t.element_size() == 1 for t in big)


def _count_scaled_mm(monkeypatch, device: str) -> list[tuple]:
    calls: list[tuple] = []
    original = torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape), b.stride()))
        return original(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    torch.manual_seed(0)
    with fs.fp8_model_init():
        layer = Linear(32, 48, device=device)
    fwd_bwd(layer, torch.randn(2, 16, 32, device=device), torch.randn(2, 16, 48, device=device),
            fs.CurrentScaling())
    return calls


def _assert_three_gemms(calls: list[tuple]) -> None:
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert calls == [
        (e4, e4, (32, 32), (32, 48), (1, 32)),  # y = x·Wᵀ: Wᵀ column-major
        (e5, e4, (32, 48), (48, 32), (1, 48)),  # dx = dy·W: W column-major (the cached Wᵀ bytes)
        (e5, e4, (48, 32), (32, 32), (1, 32)),  # dW = dyᵀ·x: x column-major
    ]


def test_the_three_gemms_go_through_scaled_mm(monkeypatch):
    # CPU's default may be the emulated path ([Note: CPU GEMM choice]); force torch._scaled_mm.
    monkeypatch.setattr("fp8shard.fp8.gemm._setting", "scaled_mm")
    _assert_three_gemms(_count_scaled_mm(monkeypatch, "cpu"))


@pytest.mark.gpu
def test_the_three_gemms_go_through_scaled_mm_cuda(monkeypatch):
    from fp8shard.fp8.gemm import choose_gemm_path

    assert choose_gemm_path("cuda", torch.cuda.current_device(), 256, 512, 1024) == "scaled_mm"
    _assert_three_gemms(_count_scaled_mm(monkeypatch, "cuda"))


@pytest.mark.gpu
def test_misaligned_dims_are_padded_on_cuda_and_match_emulation():
    from fp8shard.fp8.gemm import choose_gemm_path

    assert choose_gemm_path("cuda", torch.cuda.current_device(), 20, 40, 24) == "padded"
    torch.manual_seed(0)
    layer = Linear(40, 24, device="cuda")
    x, dy = torch.randn(20, 40, device="cuda"), torch.randn(20, 24, device="cuda")
    padded = fwd_bwd(layer, x, dy, fs.CurrentScaling())
    with force_gemm_path("emulated"):
        emulated = fwd_bwd(layer, x, dy, fs.CurrentScaling())
    # Same FP8 inputs; cuBLAS's FP8 kernel sums in its own order and scales inside the kernel,
    # so the two agree to fp32-accumulation rounding of these small sums, not bit for bit
    # (seen on the H200: at most 1.5e-4 absolute, 9e-4 relative).
    for a, b in zip(padded, emulated, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=5e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bias_is_added_in_the_gemm_epilogue(dtype, monkeypatch):
    monkeypatch.setattr("fp8shard.fp8.gemm._setting", "scaled_mm")  # the case records its calls
    bias_epilogue_case("cpu", dtype, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_bias_is_added_in_the_gemm_epilogue_cuda(dtype, monkeypatch):
    bias_epilogue_case("cuda", dtype, monkeypatch)


@pytest.mark.parametrize("path", ["padded", "emulated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fallback_gemm_paths_add_the_bias_as_scaled_mm_does(path, dtype):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, 53, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(29, 53, generator=gen).to(torch.float8_e4m3fn)  # [N, K] row-major
    bias = (torch.randn(29, generator=gen) * 3).to(dtype)
    sa, sb = torch.tensor(0.5), torch.tensor(3.0)
    with force_gemm_path("scaled_mm"):  # the CPU default may be emulated
        ref = fp8_mm(a, sa, b.t(), sb, dtype, bias)
    with force_gemm_path(path):
        got = fp8_mm(a, sa, b.t(), sb, dtype, bias)
    assert got.shape == (37, 29)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    exact = (a.double() @ b.double().t()) * 1.5 + bias.double()
    torch.testing.assert_close(ref.double(), exact, rtol=2**-8, atol=1e-5)
    with pytest.raises(ValueError, match="1-D bias of length 29"):
        fp8_mm(a, sa, b.t(), sb, dtype, bias[:5])

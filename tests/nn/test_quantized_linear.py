"""``fs.nn.Linear`` under the rowwise and blockwise recipes ([Note: quantizer])."""

from __future__ import annotations

import pytest
import torch

import fp8shard as fs
from fp8shard.fp8.quantizer import TensorwiseQuantizer
from fp8shard.nn import Linear
from fp8shard.nn.linear import _Fp8LinearFn
from fp8shard.nn.quantized_linear import _QuantizedLinearFn
from fp8shard.testing import sqnr_db
from tests.nn._cases import compile_case, fwd_bwd, sqnr_case

TILED = {"rowwise": fs.RowwiseScaling(), "blockwise": fs.BlockwiseScaling(),
         "rowwise_hybrid": fs.RowwiseScaling(fp8_format="hybrid"),
         "blockwise_hybrid": fs.BlockwiseScaling(fp8_format="hybrid")}


@pytest.mark.parametrize("recipe", list(TILED))
def test_forward_and_backward_sqnr_against_float64(recipe):
    sqnr = sqnr_case("cpu", False, TILED[recipe])
    assert sqnr["y"] >= 25 and sqnr["dx"] >= 22 and sqnr["dw"] >= 22, sqnr
    assert sqnr["y"] < 40, "suspiciously exact: are the GEMMs really in FP8?"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(TILED))
def test_forward_and_backward_sqnr_against_float64_cuda(recipe):
    sqnr = sqnr_case("cuda", False, TILED[recipe])
    assert sqnr["y"] >= 25 and sqnr["dx"] >= 22 and sqnr["dw"] >= 22, sqnr


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_bf16_layer_on_cuda_takes_scaled_mm_and_matches_the_emulation(recipe):
    """bf16 on sm90: the recipe's torch._scaled_mm path, checked against the emulated path."""
    from fp8shard.fp8.gemm import force_gemm_path

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("sm90+")
    torch.manual_seed(0)
    layer = Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=gen).cuda().bfloat16()
    dy = torch.randn(256, 256, generator=gen).cuda().bfloat16()
    got = fwd_bwd(layer, x, dy, TILED[recipe])
    with force_gemm_path("emulated"):
        ref = fwd_bwd(layer, x, dy, TILED[recipe])
    for name, a, b in zip(("y", "dx", "dW"), got[:3], ref[:3], strict=True):
        assert sqnr_db(b.float(), a.float()) >= 40, name


def test_rowwise_beats_tensorwise_on_rows_of_different_ranges():
    """Tokens whose activations span 10^5 in range, more than E4M3's normal range (2^15): one
    scale for the tensor pushes the smallest rows into subnormals, a scale per row does not."""
    torch.manual_seed(0)
    layer = Linear(256, 128, bias=False)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-4, 1, 64)[:, None]
    dy = torch.randn(64, 128, generator=gen)
    ref = x.double() @ layer.weight.detach().double().t()
    y_row = fwd_bwd(layer, x, dy, fs.RowwiseScaling())[0]
    y_ten = fwd_bwd(layer, x, dy, fs.CurrentScaling(fp8_format="e4m3"))[0]
    rows = slice(0, 8)  # the smallest eighth of the tokens
    assert sqnr_db(ref[rows], y_row[rows]) >= sqnr_db(ref[rows], y_ten[rows]) + 3


def test_recipe_by_name_and_by_layer_attribute():
    torch.manual_seed(0)
    layer = Linear(256, 64)
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(32, 256, generator=gen), torch.randn(32, 64, generator=gen)
    by_object = fwd_bwd(layer, x, dy, fs.BlockwiseScaling())
    by_name = fwd_bwd(layer, x, dy, "blockwise")
    layer.fp8_recipe = "blockwise"  # the layer's own recipe wins over the autocast's
    by_attribute = fwd_bwd(layer, x, dy, fs.DelayedScaling())
    assert not hasattr(layer, "fp8_amax_history"), "delayed scaling state made for a blockwise layer"
    tensorwise = fwd_bwd(Linear(256, 64), x, dy, "current")
    for a, b, c in zip(by_object, by_name, by_attribute, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(by_object[0], tensorwise[0])


def test_tensorwise_quantizer_through_the_generic_function_is_todays_linear():
    """Per-tensor current scaling is one implementation of the protocol: the generic Function
    with ``TensorwiseQuantizer`` gives bit for bit what ``_Fp8LinearFn`` gives."""
    torch.manual_seed(0)
    w = torch.randn(96, 160, requires_grad=True)
    b = torch.randn(96, requires_grad=True)
    gen = torch.Generator().manual_seed(1)
    x0, dy = torch.randn(3, 40, 160, generator=gen), torch.randn(3, 40, 96, generator=gen)
    fmt = fs.RecipeFormat.HYBRID
    outs = []
    for fn, args in ((_Fp8LinearFn, (fmt.fwd, fmt.bwd, None, None)),
                     (_QuantizedLinearFn, (TensorwiseQuantizer(), fmt.fwd, fmt.bwd))):
        x = x0.clone().requires_grad_()
        w.grad = b.grad = None
        y = fn.apply(x, w, b, *args)
        y.backward(dy)
        outs.append((y.detach(), x.grad, w.grad.clone(), b.grad.clone()))
    for a, c in zip(*outs, strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize(("stored", "computed"), [(None, "rowwise"), ("rowwise", "blockwise"),
                                                 ("blockwise", "delayed"), ("rowwise", "current")])
def test_fp8_stored_weight_of_another_recipe_says_what_to_do(stored, computed):
    with fs.fp8_model_init(recipe=stored):
        layer = Linear(64, 32)
    with fs.fp8_autocast(recipe=computed), pytest.raises(
            ValueError, match=rf"the {'tensorwise' if computed in ('delayed', 'current') else computed} "
                              r"recipe "
                              r"needs its FP8-stored weight.*fp8_model_init\(recipe=...\)"):
        layer(torch.randn(4, 64))


def test_bad_recipe_name_errors_clearly():
    with pytest.raises(ValueError, match="unknown FP8 recipe 'colwise'; choose one of delayed, current"):
        with fs.fp8_autocast(recipe="colwise"):
            pass
    layer = Linear(16, 8)
    layer.fp8_recipe = "colwise"
    with fs.fp8_autocast(), pytest.raises(ValueError, match="unknown FP8 recipe 'colwise'"):
        layer(torch.randn(2, 16))


def test_no_grad_forward_and_frozen_weight():
    torch.manual_seed(0)
    layer = Linear(128, 64)
    x = torch.randn(8, 128)
    with torch.no_grad(), fs.fp8_autocast(recipe="blockwise"):
        y = layer(x)
    assert y.shape == (8, 64) and not y.requires_grad
    layer.weight.requires_grad_(False)
    xg = x.clone().requires_grad_()
    with fs.fp8_autocast(recipe="rowwise"):
        layer(xg).sum().backward()
    assert xg.grad is not None and layer.weight.grad is None
    assert sqnr_db(torch.ones(8, 64) @ layer.weight.detach(), xg.grad) >= 25


@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp-weights", "fp8-weights"])
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_compile_matches_eager_cpu(recipe, fp8_params):
    """torch.compile of a model of tiled-recipe layers (Inductor once rejected the blockwise
    scale expansion on CPU: the tile multiply now goes through a tiled view); with weights
    stored with the recipe's scales ([Note: tiled FP8 weights]) too."""
    compile_case("cpu", TILED[recipe], fp8_params)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_compile_matches_eager_with_stored_tiled_weights_cuda(recipe):
    compile_case("cuda", TILED[recipe], True)


@pytest.mark.parametrize("recipe", list(TILED))
def test_stored_tiled_weights_sqnr_against_float64(recipe):
    """Weights stored with the recipe's scales: the layer keeps the same accuracy."""
    sqnr = sqnr_case("cpu", True, TILED[recipe])
    assert sqnr["y"] >= 25 and sqnr["dx"] >= 22 and sqnr["dw"] >= 22, sqnr


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(TILED))
def test_stored_tiled_weights_sqnr_against_float64_cuda(recipe):
    sqnr = sqnr_case("cuda", True, TILED[recipe])
    assert sqnr["y"] >= 25 and sqnr["dx"] >= 22 and sqnr["dw"] >= 22, sqnr

"""fp8_model_init (FP8-stored weights), convert_to_fp8, and clear errors on bad input."""

from __future__ import annotations

import pytest
import torch

import fp8shard as fs
from fp8shard.nn import Linear
from tests.nn._cases import fwd_bwd


def test_model_init_stores_one_byte_weights_scaled_from_their_amax():
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 32)
    torch.manual_seed(0)
    with fs.fp8_model_init(preserve_high_precision_init_val=True):
        layer = Linear(64, 32)
        norm = torch.nn.LayerNorm(32)  # not ours: stays high precision
    w = layer.weight
    assert isinstance(w, fs.Float8Tensor) and isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert w.fp8_format is fs.Fp8Format.E4M3 and w.dtype == torch.float32 and w.shape == (32, 64)
    assert w.fp8_data.element_size() == 1 and w.fp8_data.untyped_storage().nbytes() == 32 * 64
    assert not isinstance(layer.bias, fs.Float8Tensor) and not isinstance(norm.weight, fs.Float8Tensor)
    # the initial value is nn.Linear's, kept on CPU, and the first scale comes from its amax
    init = w.get_high_precision_init_val()
    assert init.device.type == "cpu" and torch.equal(init, ref.weight.detach())
    assert torch.equal(w.scale_inv, (fs.Fp8Format.E4M3.max / init.abs().max()).reciprocal())
    assert w.scale.item() != 1.0
    assert w.dequantize().abs().max() == pytest.approx(init.abs().max().item(), rel=1e-6)
    w.clear_high_precision_init_val()
    assert w.get_high_precision_init_val() is None


def test_model_init_without_preserve_keeps_no_copy_and_disabled_keeps_hp():
    with fs.fp8_model_init():
        layer = Linear(16, 16)
    assert layer.weight.get_high_precision_init_val() is None
    with fs.fp8_model_init(enabled=False):
        assert not isinstance(Linear(16, 16).weight, fs.Float8Tensor)


def test_reset_parameters_requantizes_fp8_weight():
    with fs.fp8_model_init(preserve_high_precision_init_val=True):
        layer = Linear(16, 16, dtype=torch.bfloat16)
    weight, before = layer.weight, layer.weight.uint8_view().clone()
    torch.manual_seed(3)
    layer.reset_parameters()
    assert layer.weight is weight and not torch.equal(weight.uint8_view(), before)
    init = weight.get_high_precision_init_val()
    assert init.dtype == torch.bfloat16
    assert torch.equal(weight.uint8_view(), fs.Float8Tensor.quantize(init).uint8_view())


def test_model_init_rejects_non_float_dtype():
    with fs.fp8_model_init(), pytest.raises(TypeError, match=r"torch.int8.*dtype=torch.bfloat16"):
        Linear(16, 16, dtype=torch.int8)
    with fs.fp8_model_init(), pytest.raises(TypeError, match="nominal dtype"):
        Linear(16, 16, dtype=torch.float8_e4m3fn)


def test_fp8_autocast_rejects_wrong_recipe_type():
    class TERecipe:  # e.g. a Transformer Engine recipe object
        pass

    with pytest.raises(TypeError, match=r"TERecipe.*fp8shard.DelayedScaling\(...\)"):
        with fs.fp8_autocast(recipe=TERecipe()):
            pass
    with pytest.raises(TypeError, match="enabled"):
        with fs.fp8_autocast(enabled="yes"):
            pass
    assert fs.nn.autocast.current_fp8_state() is None  # nothing left on the stack


def test_convert_to_fp8_keeps_values_and_skips_the_head():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(10, 32))
    model.add_module("up", torch.nn.Linear(32, 64))
    model.add_module("down", torch.nn.Linear(64, 32, bias=False))
    model.add_module("lm_head", torch.nn.Linear(32, 10))
    up_weight = model.up.weight
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    assert fs.convert_to_fp8(model) is model
    assert type(model.up) is Linear and type(model.down) is Linear
    assert type(model.lm_head) is torch.nn.Linear and type(model.embed) is torch.nn.Embedding
    assert model.up.weight is up_weight  # the same Parameter: an optimizer built before still works
    assert model.down.bias is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    x = torch.randint(0, 10, (4, 6))
    with fs.fp8_autocast(recipe=fs.CurrentScaling()):
        logits = model(x)
    assert logits.shape == (4, 6, 10)


def test_convert_to_fp8_with_fp8_params_and_custom_filter():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    w0 = model[0].weight.detach().clone()
    fs.convert_to_fp8(model, module_filter=lambda fqn, m: fqn == "0", fp8_params=True)
    assert type(model[0]) is Linear and type(model[1]) is torch.nn.Linear
    w = model[0].weight
    assert isinstance(w, fs.Float8Tensor) and w.requires_grad
    assert torch.equal(w.uint8_view(), fs.Float8Tensor.quantize(w0).uint8_view())
    _y, dx, _dw, _ = fwd_bwd(model, torch.randn(4, 16), torch.randn(4, 8), fs.CurrentScaling())
    assert model[0].weight.grad.shape == (32, 16) and dx.shape == (4, 16)


def test_convert_to_fp8_rejects_a_bare_linear():
    with pytest.raises(TypeError, match="Sequential"):
        fs.convert_to_fp8(torch.nn.Linear(4, 4))


def test_fp8_weights_built_on_meta_materialize_with_to_empty():
    with fs.fp8_model_init(preserve_high_precision_init_val=True):
        layer = Linear(64, 32, device="meta")
    assert isinstance(layer.weight, fs.Float8Tensor) and layer.weight.device.type == "meta"
    layer.to_empty(device="cpu")
    assert isinstance(layer.weight, fs.Float8Tensor) and isinstance(layer.weight, torch.nn.Parameter)
    torch.manual_seed(0)
    layer.reset_parameters()
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 32)
    assert torch.equal(layer.weight.get_high_precision_init_val(), ref.weight.detach())
    assert torch.equal(layer.weight.uint8_view(), fs.Float8Tensor.quantize(ref.weight.detach()).uint8_view())

"""Which layers compute in FP8 ([Note: FP8 layer filter], nn/gemm_filter.py): the shape rule,
``select_fp8_layers`` by policy and device, a filtered layer computing in high precision from its
FP8-stored weight, and the training command's ``model.fp8_layers``."""

from __future__ import annotations

import pytest
import torch

import fp8shard as fs
from fp8shard.models import GPT, GPTConfig
from fp8shard.nn import Linear, fp8_gemm_pays, select_fp8_layers
from fp8shard.nn.gemm_filter import MIN_FP8_FEATURES, MIN_FP8_WEIGHT_ELEMENTS


def _gpt(hidden: int, ffn: int) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=64, num_layers=2, hidden_size=hidden, ffn_hidden_size=ffn,
                             num_attention_heads=4, max_position_embeddings=16))


def test_the_rule_keeps_large_layers_and_drops_small_ones():
    assert fp8_gemm_pays(2048, 6144) and fp8_gemm_pays(8192, 2048) and fp8_gemm_pays(4096, 14336)
    assert not fp8_gemm_pays(768, 3072) and not fp8_gemm_pays(3072, 768)  # GPT-2 small's FFN
    assert fp8_gemm_pays(2048, 2048)  # 4.2M weights: kept in FP8 (the 1.3B step's measured 1.17x)
    assert not fp8_gemm_pays(1536, 1536)  # 2.4M: GPT-2 small's size, faster in bf16
    assert not fp8_gemm_pays(MIN_FP8_FEATURES - 16, 1 << 20)  # too narrow, however long
    n = MIN_FP8_WEIGHT_ELEMENTS // 2048
    assert fp8_gemm_pays(2048, n) and not fp8_gemm_pays(2048, n - 1)  # the weight count decides
    assert not fp8_gemm_pays(2048, 2048, min_weights=2 ** 23)  # a run's own threshold
    assert select_fp8_layers(_gpt(2048, 8192), "auto", "cuda", min_weights=2 ** 23) == (6, 8)


@pytest.mark.parametrize(("hidden", "ffn", "on_cuda"), [(768, 3072, 0), (2048, 8192, 8), (4096, 512, 4)])
def test_auto_filters_on_cuda_only_and_all_keeps_every_layer(hidden, ffn, on_cuda):
    """Per block: qkv [h -> 3h], proj [h -> h], fc1 [h -> ffn], fc2 [ffn -> h]; 2 blocks. At
    1.3B shapes (2048, 8192) all four compute in FP8; with a 512-wide FFN its layers do not."""
    model = _gpt(hidden, ffn)
    assert select_fp8_layers(model, "auto", "cuda") == (on_cuda, 8)
    kept = {(m.in_features, m.out_features) for m in model.modules()
            if isinstance(m, Linear) and m.fp8_compute}
    assert all(fp8_gemm_pays(i, o) for i, o in kept)
    assert select_fp8_layers(model, "auto", "cpu") == (8, 8)  # CPU runs are for the numerics
    assert select_fp8_layers(model, "all", "cuda") == (8, 8)
    assert all(m.fp8_compute for m in model.modules() if isinstance(m, Linear))


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match=r"auto, all \(model\.fp8_layers\)"):
        select_fp8_layers(_gpt(64, 128), "some")


@pytest.mark.parametrize("recipe", [fs.CurrentScaling(), fs.DelayedScaling(), fs.RowwiseScaling()])
@pytest.mark.parametrize("fp8_params", [False, True])
def test_a_filtered_layer_computes_in_high_precision_from_its_weight(recipe, fp8_params):
    torch.manual_seed(0)
    with fs.fp8_model_init(enabled=fp8_params, recipe=recipe if fp8_params else None):
        layer = Linear(64, 48)
    weight = layer.weight.dequantize() if fp8_params else layer.weight.detach()
    x = torch.randn(16, 64, requires_grad=True)
    dy = torch.randn(16, 48)
    ref_x = x.detach().clone().requires_grad_()
    ref_w = weight.clone().requires_grad_()
    ref = torch.nn.functional.linear(ref_x, ref_w, layer.bias.detach())
    ref.backward(dy)

    with fs.fp8_autocast(recipe=recipe):
        fp8 = layer(x)
    assert not torch.equal(fp8, ref)  # FP8 compute differs from the exact product...
    layer.fp8_compute = False
    with fs.fp8_autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    assert torch.equal(y, ref)  # ...the filtered layer is the exact product
    assert torch.equal(x.grad, ref_x.grad)
    assert torch.equal(layer.weight.grad, ref_w.grad)
    assert isinstance(layer.weight, fs.Float8Tensor) == fp8_params  # storage unchanged
    assert "fp8_compute=False" in repr(layer)


def test_filtered_layers_get_no_delayed_state_and_amax_sync_skips_them():
    model = torch.nn.Sequential(Linear(32, 32), Linear(32, 32))
    model[0].fp8_compute = False
    recipe = fs.DelayedScaling()
    assert fs.nn.prepare_delayed_scaling(model, recipe) == 1
    assert not hasattr(model[0], "fp8_amax_history") and hasattr(model[1], "fp8_amax_history")
    sync = fs.nn.AmaxSync(model)
    with fs.fp8_autocast(recipe=recipe):
        model(torch.randn(8, 32)).sum().backward()
    assert sync.layers() == [model[1]] and sync.step() == 1


def test_training_command_reports_its_fp8_layers(tmp_path):
    from fp8shard.train.config import load_config
    from fp8shard.train.distributed import DistEnv
    from fp8shard.train.loop import Trainer
    from tests.reliability.common import run_args

    args = run_args(tmp_path / "run", "trainer.max_steps=1", "model.fp8_layers=auto")
    cfg = load_config(args, world_size=1)
    trainer = Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None))
    layers = sum(isinstance(m, Linear) for m in trainer.model.modules())
    summary = trainer.fit()
    assert summary["fp8"]["fp8_layers"] == "auto"
    assert summary["fp8"]["fp8_compute_layers"] == [layers, layers]  # auto on the CPU: every layer


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_filtered_fp8_weight_keeps_its_bytes_for_backward(autocast):
    """A layer computing in high precision from an FP8-stored weight dequantizes it again in
    the backward: what the backward keeps of the weight is the Float8Tensor (its 1-byte
    storage), no 16-bit copy; and the results are autograd's for F.linear of the dequantized
    weight, bit for bit, in fp32 and under bf16 autocast (x fp32, bias fp32)."""
    torch.manual_seed(0)
    with fs.fp8_model_init():
        layer = Linear(64, 48)
    layer.bias.data = layer.bias.data.float()
    layer.fp8_compute = False
    x = torch.randn(2, 8, 64, requires_grad=True)
    dy = torch.randn(2, 8, 48)
    ref_x = x.detach().clone().requires_grad_()
    ref_w = layer.weight.dequantize().requires_grad_()
    ref_b = layer.bias.detach().clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        ref = torch.nn.functional.linear(ref_x, ref_w, ref_b)
    ref.backward(dy.to(ref.dtype))

    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), fs.fp8_autocast():
            y = layer(x)
    y.backward(dy.to(y.dtype))
    assert torch.equal(y, ref)
    assert torch.equal(x.grad, ref_x.grad) and x.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, ref_w.grad)
    assert torch.equal(layer.bias.grad, ref_b.grad) and layer.bias.grad.dtype == torch.float32
    weights = [t for t in saved if tuple(t.shape) == (48, 64)]
    assert weights and all(isinstance(t, fs.Float8Tensor) for t in weights)
    assert not any(tuple(t.shape) in ((48, 64), (64, 48)) and not isinstance(t, fs.Float8Tensor)
                   for t in saved)


@pytest.mark.parametrize("nominal", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_the_backward_dequantize_is_the_forward_one_bit_for_bit(nominal, fmt):
    """[Note: dequantize again]: the backward's dequantize (the product's operands swapped) gives
    the bits of ``dequantize()``, on every FP8 code (NaN included) and a random scale."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(4).view(32, 32)
    f = fs.Fp8Format.parse(fmt)
    w = fs.Float8Tensor(codes.view(f.torch_dtype), torch.tensor(0.0123), f, nominal)
    got, want = w.dequantize(scale_first=True), w.dequantize()
    assert got.dtype == want.dtype == nominal
    assert torch.equal(got.view(torch.int16 if nominal == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if nominal == torch.bfloat16 else torch.int32))


def test_compiled_gpt_keeps_no_16bit_copy_of_its_fp8_weights_for_backward():
    """Inductor's forward graph of a GPT whose layers compute in bf16 from FP8-stored weights
    returns (saves for the backward) no buffer of a weight's shape: the backward dequantizes the
    bytes again ([Note: dequantize again]). Before, the graph merged the two dequantizes and kept
    a 16-bit copy of every weight from the forward to the backward."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, max_position_embeddings=64, num_layers=2, hidden_size=128,
                    ffn_hidden_size=512, num_attention_heads=4)
    with fs.fp8_model_init():
        model = GPT(cfg)
    select_fp8_layers(model, "all")
    for m in model.modules():
        if isinstance(m, Linear):
            m.fp8_compute = False
    x, y = torch.randint(0, 512, (3, 40)), torch.randint(0, 512, (3, 40))  # 120 tokens
    step = torch.compile(lambda a, b: model(a, b))
    with torch.autocast("cpu", dtype=torch.bfloat16), fs.fp8_autocast():
        _, codes = run_and_get_code(lambda: step(x, y).backward())
    forward = next(c for c in codes if "def call(" in c)
    body = forward[forward.index("def call("):]
    shapes = {name: shape for name, shape in
              re.findall(r"(buf\d+) = empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.\w+\)", body)}
    returned = [ln for ln in body.splitlines() if ln.strip().startswith("return (")][-1]
    saved = re.findall(r"\b(buf\d+)\b", returned)
    weight_shapes = {"384, 128", "128, 128", "512, 128", "128, 512"}
    assert saved and not [n for n in saved if shapes.get(n) in weight_shapes]


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_the_backward_dequantize_of_a_tiled_weight_is_the_forward_one_bit_for_bit(recipe):
    """[Note: dequantize again] for rowwise and blockwise weights (partial tiles included)."""
    torch.manual_seed(0)
    r = fs.RowwiseScaling() if recipe == "rowwise" else fs.BlockwiseScaling()
    with fs.fp8_model_init(recipe=r):
        layer = Linear(300, 200)
    w = layer.weight
    assert isinstance(w, fs.Float8Tensor) and w.block is not None
    assert torch.equal(w.dequantize(scale_first=True).view(torch.int32), w.dequantize().view(torch.int32))

"""Test bodies shared by the CPU tests and their ``@pytest.mark.gpu`` twins (device is a str)."""

from __future__ import annotations

import torch

import fp8shard as fs
from fp8shard.nn import Linear
from fp8shard.testing import sqnr_db

TOKENS, IN, OUT = 256, 512, 1024


def fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: object) -> tuple:
    """One FP8 forward + backward; returns (y, dx, dW, dbias)."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with fs.fp8_autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    return (y.detach(), x.grad, None if weight is None else weight.grad,
            None if bias is None else bias.grad)


def sqnr_case(device: str, fp8_params: bool, recipe: object) -> dict[str, float]:
    """SQNR (dB) of y, dx and dW of an FP8 Linear against float64 math on the same hp values."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, IN, generator=gen).to(device)
    dy = torch.randn(TOKENS, OUT, generator=gen).to(device)
    torch.manual_seed(1)
    tiled = fp8_params and isinstance(recipe, (fs.RowwiseScaling, fs.BlockwiseScaling))
    with fs.fp8_model_init(enabled=fp8_params, preserve_high_precision_init_val=True,
                           recipe=recipe if tiled else None):
        layer = Linear(IN, OUT, device=device)
    w = layer.weight.get_high_precision_init_val() if fp8_params else layer.weight.detach()
    w64, x64, dy64 = w.to(device).double(), x.double(), dy.double()
    for _ in range(2):  # the second step: delayed scaling has seen one amax by then
        y, dx, dw, _ = fwd_bwd(layer, x, dy, recipe)
    return {
        "y": sqnr_db(x64 @ w64.t() + layer.bias.double(), y),
        "dx": sqnr_db(dy64 @ w64, dx),
        "dw": sqnr_db(dy64.t() @ x64, dw),
    }


def bit_identical_case(device: str, recipe: object) -> None:
    """FP8-stored weights vs FP8 compute from the same hp weight quantized with the same scale."""
    torch.manual_seed(0)
    with fs.fp8_model_init(preserve_high_precision_init_val=True):
        fp8_layer = Linear(IN, OUT, device=device)
    hp_layer = Linear(IN, OUT, device=device)
    with torch.no_grad():
        hp_layer.weight.copy_(fp8_layer.weight.get_high_precision_init_val())
        hp_layer.bias.copy_(fp8_layer.bias)
    gen = torch.Generator().manual_seed(2)
    steps = 2 if isinstance(recipe, fs.DelayedScaling) else 1
    sync = fs.nn.AmaxSync(torch.nn.ModuleList([fp8_layer, hp_layer]))
    for _ in range(steps):  # delayed: step 1 teaches the hp layer its weight's scale
        x = torch.randn(4, TOKENS // 4, IN, generator=gen).to(device)
        dy = torch.randn(4, TOKENS // 4, OUT, generator=gen).to(device)
        got_fp8 = fwd_bwd(fp8_layer, x, dy, recipe)
        got_hp = fwd_bwd(hp_layer, x, dy, recipe)
        sync.step()
    if isinstance(recipe, fs.DelayedScaling):
        # the precondition of the comparison: the hp weight was cast with the FP8 weight's scale
        assert torch.equal(hp_layer.fp8_scale[1].reciprocal(), fp8_layer.weight.scale_inv)
    assert isinstance(fp8_layer.weight, fs.Float8Tensor)
    assert not isinstance(hp_layer.weight, fs.Float8Tensor)
    for name, a, b in zip(("y", "dx", "dW", "dbias"), got_fp8, got_hp, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs: max |diff| {(a - b).abs().max().item()}"
    assert type(got_fp8[2]) is torch.Tensor and got_fp8[2].dtype == fp8_layer.weight.dtype


def compile_case(device: str, recipe: object, fp8_params: bool) -> None:
    """A small MLP of fp8shard Linears: torch.compile under fp8_autocast matches eager.

    Starts from a clean Dynamo (``torch._dynamo.reset()``): on torch 2.11, compiling the per-tensor
    layer's Function after a tiled recipe's in the same process fails inside Dynamo
    ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer"), whichever
    test runs first; each case checks its own recipe (docs/fp8.md, "torch.compile")."""
    torch._dynamo.reset()

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        tiled = fp8_params and isinstance(recipe, (fs.RowwiseScaling, fs.BlockwiseScaling))
        with fs.fp8_model_init(enabled=fp8_params, recipe=recipe if tiled else None):
            return torch.nn.Sequential(
                Linear(64, 128, device=device), torch.nn.ReLU(), Linear(128, 64, device=device)
            )

    eager, compiled_inner = build(), build()
    compiled = torch.compile(compiled_inner)
    syncs = {id(eager): fs.nn.AmaxSync(eager), id(compiled): fs.nn.AmaxSync(compiled_inner)}
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2, 16, 64, generator=gen).to(device)
        dy = torch.randn(2, 16, 64, generator=gen).to(device)
        results = []
        for model in (eager, compiled):
            xi = x.clone().requires_grad_()
            with fs.fp8_autocast(recipe=recipe):
                y = model(xi)
            y.backward(dy)
            syncs[id(model)].step()
            first = getattr(model, "_orig_mod", model)[0]
            results.append((y.detach(), xi.grad, first.weight.grad.clone()))
            model.zero_grad(set_to_none=True)
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if isinstance(recipe, fs.DelayedScaling):
        for a, b in zip(eager.modules(), compiled_inner.modules(), strict=True):
            if isinstance(a, Linear):
                assert a.fp8_amax_history.abs().sum() > 0
                torch.testing.assert_close(a.fp8_amax_history, b.fp8_amax_history)
                torch.testing.assert_close(a.fp8_scale, b.fp8_scale)


def bias_epilogue_case(device: str, dtype: torch.dtype, monkeypatch) -> None:
    """The bias goes into the forward GEMM's epilogue ([Note: bias epilogue]) where the output is
    16-bit: added to the fp32 result, rounded once; its gradient is the column sum of dy."""
    from fp8shard.fp8 import Float8Tensor, Fp8Format
    from fp8shard.fp8.gemm import fp8_mm

    biases: list[torch.Tensor | None] = []
    original = torch._scaled_mm

    def recording(*args, **kwargs):
        biases.append(kwargs.get("bias"))
        return original(*args, **kwargs)

    torch.manual_seed(0)
    with fs.fp8_model_init():
        layer = Linear(64, 48, device=device, dtype=dtype)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(48, device=device) * 3)  # big enough for roundings to show
    x = torch.randn(2, 16, 64, device=device, dtype=dtype)
    dy = torch.randn(2, 16, 48, device=device, dtype=dtype)
    monkeypatch.setattr(torch, "_scaled_mm", recording)
    y, _, _, db = fwd_bwd(layer, x, dy, fs.CurrentScaling())
    monkeypatch.setattr(torch, "_scaled_mm", original)
    epilogue = dtype in (torch.bfloat16, torch.float16)
    assert len(biases) == 3 and biases[1] is None and biases[2] is None  # dgrad and wgrad: none
    assert (biases[0] is layer.bias) == epilogue  # the forward GEMM takes it (16-bit output)
    xq = Float8Tensor.quantize(x.reshape(-1, 64), Fp8Format.E4M3)
    w = layer.weight
    acc = fp8_mm(xq._data, xq._scale_inv, w._data.t(), w._scale_inv, torch.float32)
    ref = (acc + layer.bias.detach().float()).to(dtype)  # one rounding
    if device == "cpu":
        assert torch.equal(y.reshape(-1, 48), ref)
    else:  # cuBLAS may fuse the scale and the bias add (one fma): one ulp at most
        torch.testing.assert_close(y.reshape(-1, 48), ref, rtol=2**-7, atol=0)
    if epilogue:  # a separate add would round twice: it shows somewhere in 1536 outputs
        assert not torch.equal(ref, acc.to(dtype) + layer.bias.detach())
    assert db is not None and db.dtype == dtype
    db_ref = dy.reshape(-1, 48).float().sum(0).to(dtype)
    if device == "cpu":
        assert torch.equal(db, db_ref)
    else:  # another summation order of the same fp32 sums
        torch.testing.assert_close(db, db_ref, rtol=2**-7, atol=1e-6)

"""torch.compile(fullgraph=True) of fp8shard Linears and the GPT: one graph, no break, no recompile.

Each mode (current / delayed scaling x high-precision / FP8-stored weights) is compiled with
``fullgraph=True``, so a graph break reintroduced anywhere in the layer, the GPT or the FP8
code fails here. ``torch._dynamo.config.error_on_recompile`` makes a recompilation fail too.
Backend ``aot_eager`` (Dynamo + AOT autograd, no Inductor codegen) except where Inductor is
what is tested. Tolerances: ``aot_eager`` runs the same ATen ops as eager, so outputs and
gradients must agree to fp32 rounding (rtol 1e-5, atol 1e-6; observed: bit-identical);
Inductor reorders fp32 arithmetic (rtol 1e-4, atol 1e-5; observed differences <= 3e-7).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import fp8shard as fs
from fp8shard.fp8.tensor import Float8Tensor
from fp8shard.models import GPT, GPTConfig
from fp8shard.nn import Linear
from fp8shard.nn.gemm_filter import count_fp8_layers
from fp8shard.optim import DistributedFusedAdam

AOT = {"rtol": 1e-5, "atol": 1e-6}
INDUCTOR = {"rtol": 1e-4, "atol": 1e-5}
RECIPES = {"current": fs.CurrentScaling, "delayed": lambda: fs.DelayedScaling(amax_history_len=4)}
TINY_GPT = GPTConfig(vocab_size=64, max_position_embeddings=16, num_layers=2, hidden_size=32,
                     ffn_hidden_size=64, num_attention_heads=2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def _one_recompile_if_delayed(recipe: object) -> Any:
    """[Note: informed first call]: a delayed-scaling layer's first call casts as current
    scaling and clears a Python flag, so it is compiled twice (first call, then every later
    one); the graph counts below check that it is only twice."""
    return torch._dynamo.config.patch(error_on_recompile=not isinstance(recipe, fs.DelayedScaling))


def _graphs(recipe: object) -> int:
    return 2 if isinstance(recipe, fs.DelayedScaling) else 1


def _build(kind: str, fp8_params: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with fs.fp8_model_init(enabled=fp8_params):
        if kind == "linear":
            return torch.nn.Sequential(Linear(32, 64), torch.nn.ReLU(), Linear(64, 32))
        return GPT(TINY_GPT)


def _steps(model: torch.nn.Module, kind: str, recipe: object, n: int = 3) -> list[tuple]:
    """n forward + backward steps under fp8_autocast; (output, input grad, param grads) each."""
    gen = torch.Generator().manual_seed(1)
    inner = getattr(model, "_orig_mod", model)
    sync = fs.nn.AmaxSync(inner)  # eager, between the compiled steps
    out = []
    for _ in range(n):
        if kind == "linear":
            x = torch.randn(2, 16, 32, generator=gen).requires_grad_()
            with fs.fp8_autocast(recipe=recipe):
                y = model(x)
            y.pow(2).mean().backward()
            sync.step()
            got = (y.detach(), x.grad)
        else:
            idx = torch.randint(0, 64, (2, 16), generator=gen)
            with fs.fp8_autocast(recipe=recipe):
                y = model(idx, idx)
            y.backward()
            sync.step()
            got = (y.detach(),)
        out.append(got + tuple(p.grad.clone() for p in inner.parameters()))
        inner.zero_grad(set_to_none=True)
    return out


def _assert_same(ref: list[tuple], got: list[tuple], tol: dict) -> None:
    for step, (a_step, b_step) in enumerate(zip(ref, got, strict=True)):
        for i, (a, b) in enumerate(zip(a_step, b_step, strict=True)):
            torch.testing.assert_close(b, a, **tol, msg=lambda m, s=step, i=i: f"step {s}, item {i}: {m}")


def _fp8_state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b for m in model.modules() if isinstance(m, Linear)
            for b in (getattr(m, "fp8_amax_history", None), getattr(m, "fp8_scale", None)) if b is not None]


@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp_weight", "fp8_weight"])
@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
@pytest.mark.parametrize("kind", ["linear", "gpt"])
def test_fullgraph_compile_matches_eager(kind, recipe_name, fp8_params):
    recipe = RECIPES[recipe_name]()
    eager, inner = _build(kind, fp8_params), _build(kind, fp8_params)
    for m in (eager, inner):  # the delayed-scaling state exists before the first compiled call
        fs.nn.prepare_delayed_scaling(m, recipe)
    compiled = torch.compile(inner, backend="aot_eager", fullgraph=True)
    with _one_recompile_if_delayed(recipe):
        got = _steps(compiled, kind, recipe)
    ref = _steps(eager, kind, recipe)
    _assert_same(ref, got, AOT)
    assert counters["stats"]["unique_graphs"] == _graphs(recipe)  # one graph for every later step
    for a, b in zip(_fp8_state(eager), _fp8_state(inner), strict=True):  # amax histories, scales
        torch.testing.assert_close(b, a, **AOT)
    if recipe_name == "delayed":
        assert _fp8_state(inner) and all(h.abs().sum() > 0 for h in _fp8_state(inner)[::2])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_with_fp8_weights_computing_in_bf16(backend):
    """The GPT with its MLP layers out of FP8 compute ([Note: FP8 layer filter]), their weights
    FP8-stored (dequantized in the forward and again in the backward): one graph, as eager."""
    recipe = RECIPES["current"]()
    eager, inner = _build("gpt", True), _build("gpt", True)
    for m in (eager, inner):
        for name, layer in m.named_modules():
            if isinstance(layer, Linear) and name.rsplit(".", 1)[-1].startswith("fc"):
                layer.fp8_compute = False
    assert count_fp8_layers(inner) == (4, 8)  # qkv and proj of 2 blocks; fc1, fc2 in bf16
    got = _steps(torch.compile(inner, backend=backend, fullgraph=True), "gpt", recipe)
    _assert_same(_steps(eager, "gpt", recipe), got, AOT if backend == "aot_eager" else INDUCTOR)
    assert counters["stats"]["unique_graphs"] == 1


def test_inductor_fp8_weights_delayed_matches_eager():
    recipe = RECIPES["delayed"]()
    eager, inner = _build("linear", True), _build("linear", True)
    for m in (eager, inner):
        fs.nn.prepare_delayed_scaling(m, recipe)
    with _one_recompile_if_delayed(recipe):
        got = _steps(torch.compile(inner, fullgraph=True), "linear", recipe)
    _assert_same(_steps(eager, "linear", recipe), got, INDUCTOR)


def test_blocks_compiled_one_by_one_share_one_graph():
    """The training command's per-block compile: every block and step reuse one graph (the
    layers' amax registration does not make Dynamo guard on per-block Python state)."""
    recipe = RECIPES["delayed"]()
    eager, model = _build("gpt", True), _build("gpt", True)
    for m in (eager, model):
        fs.nn.prepare_delayed_scaling(m, recipe)
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    with _one_recompile_if_delayed(recipe):
        got = _steps(model, "gpt", recipe)
    _assert_same(_steps(eager, "gpt", recipe), got, AOT)
    assert counters["stats"]["unique_graphs"] == _graphs(recipe)
    assert list(model.state_dict()) == list(eager.state_dict())  # no _orig_mod. prefix


def test_fp8_weights_in_distributed_fused_adam_buffers_compile():
    """DistributedFusedAdam re-points each FP8 weight's bytes into its bucket buffer (a view at an
    offset) and rewrites them every step: the compiled model follows the new bytes."""
    models = [_build("gpt", True) for _ in range(2)]
    opts = [DistributedFusedAdam(m.parameters(), lr=1e-2) for m in models]
    compiled = torch.compile(models[1], backend="aot_eager", fullgraph=True)
    offsets = [p.fp8_data.storage_offset() for p in models[1].parameters() if isinstance(p, Float8Tensor)]
    assert any(offsets)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 16), generator=gen)
        losses = []
        for model, opt in zip((models[0], compiled), opts, strict=True):
            with fs.fp8_autocast(recipe=fs.CurrentScaling()):
                loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **AOT)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        if isinstance(a, Float8Tensor):
            assert torch.equal(a.uint8_view(), b.uint8_view()) and torch.equal(a.scale_inv, b.scale_inv)


def test_float8_tensor_repr_while_traced():
    """torch 2.11 formats the fake inputs while compiling: a repr that read values failed the
    whole compilation on CUDA (the compiled FP8-weight layer then ran eagerly)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = Float8Tensor.quantize(torch.randn(4, 8))
    assert repr(fake).startswith("Float8Tensor(fp8_format=E4M3") and "scale_inv" not in repr(fake)
    assert "scale_inv=" in repr(Float8Tensor.quantize(torch.randn(4, 8)))


def test_gemm_fallback_report_under_compile(monkeypatch):
    """The once-per-process report of a non-_scaled_mm path runs while tracing: no graph break."""
    from fp8shard.fp8 import gemm

    monkeypatch.setattr(gemm, "_reported", set())

    def path_code(x: torch.Tensor) -> torch.Tensor:
        path = gemm.choose_gemm_path("xla", 0, x.shape[0], 32, 48)  # an emulated device
        return x * (2.0 if path == "emulated" else 3.0)

    fn = torch.compile(path_code, backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert torch.equal(fn(torch.ones(16)), torch.full((16,), 2.0))
    assert [str(w.message) for w in caught if "emulated" in str(w.message)] != []
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


def test_layer_that_did_not_run_keeps_its_state():
    """AmaxSync reduces every layer with delayed-scaling state at every step; one that recorded
    nothing since the last step keeps its window and scales (decided on the device)."""
    recipe = RECIPES["delayed"]()
    torch.manual_seed(0)
    used, idle = Linear(16, 16), Linear(16, 16)
    both = torch.nn.ModuleList([used, idle])
    fs.nn.prepare_delayed_scaling(both, recipe)
    sync = fs.nn.AmaxSync(both)
    with fs.fp8_autocast(recipe=recipe):
        idle(torch.randn(4, 16)).sum().backward()
    assert sync.step() == 2
    before = [t.clone() for t in (idle.fp8_amax_history, idle.fp8_scale, used.fp8_amax_history)]
    for _ in range(2):
        with fs.fp8_autocast(recipe=recipe):
            used(torch.randn(4, 16)).sum().backward()
        sync.step()
    assert torch.equal(idle.fp8_amax_history, before[0]) and torch.equal(idle.fp8_scale, before[1])
    assert not torch.equal(used.fp8_amax_history, before[2])

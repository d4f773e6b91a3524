"""Delayed scaling: the amax history rolls and the scales update as [Note: scale] says, and
``AmaxSync.step()`` MAX-reduces the amaxes of all layers over the group in one collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fp8shard as fs
from fp8shard.nn import Linear
from tests.nn._cases import fwd_bwd

FMT_MAX = torch.tensor([448.0, 448.0, 57344.0])  # input, weight (E4M3), output gradient (E5M2)


def _with_amax(shape: tuple[int, ...], amax: float, gen: torch.Generator) -> torch.Tensor:
    """Random values in (-amax/2, amax/2) plus one entry of exactly -amax: amax(x) == amax."""
    x = (torch.rand(shape, generator=gen) - 0.5) * amax
    x.view(-1)[7] = -amax
    return x


def _expected_after_update(completed: list[list[float]], length: int) -> torch.Tensor:
    """The history after an update: row 0 free, then the newest ``length - 1`` steps, oldest first."""
    rows = [[0.0, 0.0, 0.0]] * length + completed
    return torch.tensor([[0.0, 0.0, 0.0], *rows[len(rows) - length + 1:]])


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_history_rolls_and_scales_update_as_specified(algo):
    length, margin = 3, 1
    recipe = fs.DelayedScaling(margin=margin, amax_history_len=length, amax_compute_algo=algo)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = Linear(16, 32, bias=False)
    w_amax = layer.weight.detach().abs().max().item()
    x_amaxes, dy_amaxes = [1.0, 6.0, 2.0, 0.5, 3.0], [1e-3, 4e-4, 8e-3, 1e-3, 2e-4]
    completed: list[list[float]] = []
    expected_scale = torch.ones(3)
    sync = fs.nn.AmaxSync(layer)
    for xa, ga in zip(x_amaxes, dy_amaxes, strict=True):
        x, dy = _with_amax((8, 16), xa, gen), _with_amax((8, 32), ga, gen)
        y = fwd_bwd(layer, x, dy, recipe)[0]
        # this step cast with the scales of the previous update (the first: with its own
        # amaxes, as current scaling, [Note: informed first call]) ...
        assert torch.equal(layer.fp8_scale, expected_scale.float())
        used = FMT_MAX / torch.tensor([xa, w_amax, ga]) if not completed else layer.fp8_scale
        xq = fs.Float8Tensor.quantize(x, scale=used[0]).dequantize()
        wq = fs.Float8Tensor.quantize(layer.weight.detach(), scale=used[1]).dequantize()
        torch.testing.assert_close(y, xq @ wq.t(), rtol=1e-5, atol=1e-5)
        # ... and recorded its own amaxes in the free row 0
        pending = [xa, w_amax, ga]
        torch.testing.assert_close(layer.fp8_amax_history[0], torch.tensor(pending), rtol=0, atol=0)
        assert sync.step() == 1
        window = torch.tensor([*completed[-(length - 1):], pending])  # the rows the update sees
        amax = window.amax(dim=0) if algo == "max" else window[-1]
        expected_scale = FMT_MAX / amax / 2**margin
        completed.append(pending)
        assert torch.equal(layer.fp8_scale, expected_scale.float())
        torch.testing.assert_close(layer.fp8_amax_history, _expected_after_update(completed, length),
                                   rtol=0, atol=0)
    if algo == "max":  # the 6.0 of step 2 left the window after step 4
        assert layer.fp8_scale[0] == 448.0 / 3.0 / 2


class _CountingAllReduce:
    """Wraps ``torch.distributed.all_reduce`` (what the collectives module calls) to count calls;
    ``fail=True``: any call is an error (nothing may communicate)."""

    def __init__(self, fail: bool = False) -> None:
        self.numels: list[int] = []
        self.fail = fail

    def __enter__(self) -> _CountingAllReduce:
        self.original = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            if self.fail:
                raise AssertionError("an all-reduce where none may run")
            self.numels.append(tensor.numel())
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self.original


def test_autocast_entry_neither_updates_nor_communicates():
    torch.manual_seed(0)
    layer = Linear(16, 16)
    recipe = fs.DelayedScaling(amax_history_len=4)
    fwd_bwd(layer, torch.randn(4, 16), torch.randn(4, 16), recipe)
    recorded = layer.fp8_amax_history[0].clone()
    assert (recorded > 0).all()
    with _CountingAllReduce(fail=True), fs.fp8_autocast(recipe=recipe):
        # no update on entry: row 0 still holds the amaxes, the scales are the initial ones
        assert torch.equal(layer.fp8_amax_history[0], recorded)
        assert torch.equal(layer.fp8_scale, torch.ones(3))
    assert fs.nn.AmaxSync(layer).step() == 1
    assert torch.equal(layer.fp8_amax_history[-1], recorded)  # rolled into the window
    assert torch.equal(layer.fp8_amax_history[0], torch.zeros(3))
    assert torch.equal(layer.fp8_scale, FMT_MAX / recorded)


def test_single_process_step_updates_without_a_collective():
    """Without a process group AmaxSync.step() runs no collective and updates every layer
    exactly as the layer-by-layer ``update_fp8_scales`` does."""
    assert not dist.is_initialized()
    recipe = fs.DelayedScaling(amax_history_len=4)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(Linear(16, 32), torch.nn.ReLU(), Linear(32, 8)))
    sync = fs.nn.AmaxSync(models[0])
    assert sync.world_size == 1
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, dy = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
        for model in models:
            fwd_bwd(model, x, dy, recipe)
        with _CountingAllReduce(fail=True):
            assert sync.step() == 2
        for layer in (models[1][0], models[1][2]):
            layer.update_fp8_scales()
    for a, b in zip(models[0].buffers(), models[1].buffers(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(models[0][0].fp8_scale, torch.ones(3))
    assert sync.counter.total_calls["all_reduce.fp8_activation_amax"] == 3  # counted, not sent


def test_bad_input_and_the_moved_group_argument():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        fs.nn.AmaxSync([Linear(4, 4)])
    with pytest.raises(ValueError, match=r"convert_to_fp8"):
        fs.nn.AmaxSync(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="init_process_group"):
        fs.nn.AmaxSync(Linear(4, 4), group=object())  # a group, but no process group initialized
    with pytest.raises(TypeError, match=r"AmaxSync\(model, group\)"):
        fs.nn.reduce_and_update_amaxes()  # no registry to find the layers in any more
    with pytest.warns(FutureWarning, match=r"fs\.nn\.AmaxSync\(model, group=fp8_group\)"):
        with fs.fp8_autocast(recipe=fs.DelayedScaling(), fp8_group=object()):
            pass
    assert fs.AmaxSync is fs.nn.AmaxSync


def _amax_reduction_worker(steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on every rank
    model = torch.nn.Sequential(Linear(32, 64), torch.nn.ReLU(), Linear(64, 48), Linear(48, 16))
    layers = [m for m in model if isinstance(m, Linear)]
    recipe = fs.DelayedScaling(amax_history_len=8)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    sync = fs.nn.AmaxSync(model, group=dist.group.WORLD)
    per_entry, per_sync, local, reduced = [], [], [], []
    with _CountingAllReduce() as calls:
        for _ in range(steps):
            before = len(calls.numels)
            x = torch.randn(8, 32, generator=gen) * (1 + 3 * rank)
            with fs.fp8_autocast(recipe=recipe):
                y = model(x)
            y.backward(torch.randn(8, 16, generator=gen) * (1 + rank))
            per_entry.append(len(calls.numels) - before)  # autocast, forward, backward: none
            local.append(torch.stack([m.fp8_amax_history[0].clone() for m in layers]))
            sync.step()
            per_sync.append(len(calls.numels) - before - per_entry[-1])
            reduced.append(torch.stack([m.fp8_amax_history[-1].clone() for m in layers]))
    scales = torch.stack([m.fp8_scale.clone() for m in layers])
    return {"per_entry": per_entry, "per_sync": per_sync, "numels": calls.numels,
            "local": torch.stack(local), "reduced": torch.stack(reduced), "scales": scales,
            "counted": sync.counter.total_calls["all_reduce.fp8_activation_amax"]}


def test_amax_sync_reduces_in_one_all_reduce_per_step(dist_pools):
    steps = 3
    results = dist_pools(2).run(_amax_reduction_worker, steps)
    for r in results:
        assert r["per_entry"] == [0] * steps  # fp8_autocast entry, forward, backward: no collective
        assert r["per_sync"] == [1] * steps  # one packed call, 3 layers x 3 operands
        assert r["numels"] == [9] * steps and r["counted"] == steps
    local = torch.stack([r["local"] for r in results])  # [rank, step, layer, operand]
    assert not torch.equal(local[0], local[1])  # the ranks really saw different data
    expected = local.amax(dim=0)  # the global max, step by step
    for r in results:
        assert torch.equal(r["reduced"], expected)
    # the scales every rank computed are those of the global history (window max, margin 0)
    fmt_max = FMT_MAX.expand(3, 3)
    assert torch.equal(results[0]["scales"], fmt_max / expected.amax(dim=0))
    assert torch.equal(results[1]["scales"], results[0]["scales"])


def _layers_with_amaxes(recipes: list[fs.DelayedScaling], seed: int) -> list[Linear]:
    """Layers with delayed-scaling state, some history, and a fresh row 0 (one is all zero)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i, recipe in enumerate(recipes):
        layer = Linear(8, 8)
        layer.init_delayed_scaling(recipe)
        with torch.no_grad():
            layer.fp8_amax_history.copy_(torch.rand(layer.fp8_amax_history.shape, generator=gen) * 10)
            layer.fp8_scale.copy_(torch.rand(3, generator=gen) + 0.5)
            if i == 1:
                layer.fp8_amax_history[0].zero_()  # did not run since the last reduction
            if i == 2:
                layer.fp8_amax_history[0, 2] = float("nan")  # a NaN amax keeps that scale
        layers.append(layer)
    return layers


def test_batched_scale_update_equals_layer_by_layer():
    """[Note: batched scale update]: one stacked update gives the bits the layer-by-layer
    ``update_fp8_scales`` gives, for layers of several recipes in one reduction; a layer that
    recorded nothing keeps its state."""

    recipes = [fs.DelayedScaling(amax_history_len=4), fs.DelayedScaling(amax_history_len=4),
               fs.DelayedScaling(amax_history_len=4, margin=2),
               fs.DelayedScaling(amax_history_len=6, amax_compute_algo="most_recent"),
               fs.DelayedScaling(amax_history_len=4)]
    batched, reference = _layers_with_amaxes(recipes, 0), _layers_with_amaxes(recipes, 0)
    hist_ids = [id(m.fp8_amax_history) for m in batched]
    assert fs.nn.AmaxSync(torch.nn.ModuleList(batched)).step() == len(batched)
    for layer in reference:  # the specification: one layer at a time
        if bool((layer.fp8_amax_history[0] != 0).any()):
            layer.update_fp8_scales()
    for a, b in zip(batched, reference, strict=True):
        assert torch.equal(a.fp8_amax_history.nan_to_num(-1), b.fp8_amax_history.nan_to_num(-1))
        assert torch.equal(a.fp8_scale, b.fp8_scale)
        assert a._amax_state.history is a.fp8_amax_history and a._amax_state.scale is a.fp8_scale
    assert [id(m.fp8_amax_history) for m in batched] == hist_ids  # updated in place
    assert not torch.equal(batched[0].fp8_scale, reference[0].fp8_scale * 0 + 1)  # it did change


def test_scale_update_costs_the_same_ops_for_any_layer_count():
    """The update is stacked: the ops it dispatches (GPU kernel launches) do not grow with the
    number of layers, where a loop over layers costs some twenty per layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for n_layers in (4, 32):
        sync = fs.nn.AmaxSync(torch.nn.ModuleList(
            _layers_with_amaxes([fs.DelayedScaling(amax_history_len=4)] * n_layers, 1)))
        with Count() as c:
            sync.step()
        counts.append(c.n)
    # stack, unbind and _foreach_copy_ count once per call here (views and one fused copy)
    assert counts[1] <= counts[0] + 2 * (32 - 4), counts  # unbind views only, no per-layer math

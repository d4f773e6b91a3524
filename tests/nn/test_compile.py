"""torch.compile of fp8shard Linears under fp8_autocast matches eager (CPU here, CUDA on the H200)."""

from __future__ import annotations

import pytest

import fp8shard as fs
from tests.nn._cases import compile_case

CASES = [
    pytest.param(fs.CurrentScaling(), True, id="current-fp8_weight"),
    pytest.param(fs.DelayedScaling(amax_history_len=4), False, id="delayed-hp_weight"),
]


@pytest.mark.parametrize(("recipe", "fp8_params"), CASES)
def test_compile_matches_eager_cpu(recipe, fp8_params):
    compile_case("cpu", recipe, fp8_params)


@pytest.mark.gpu
@pytest.mark.parametrize(("recipe", "fp8_params"), [
    *CASES,
    pytest.param(fs.DelayedScaling(), True, id="delayed-fp8_weight"),
    pytest.param(fs.CurrentScaling(), False, id="current-hp_weight"),
])
def test_compile_matches_eager_cuda(recipe, fp8_params):
    compile_case("cuda", recipe, fp8_params)


@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp_weight", "fp8_weight"])
def test_delayed_state_made_under_compile_on_older_dynamo(fp8_params, monkeypatch):
    """torch < 2.13 (flag forced here; set by itself there): a delayed-scaling layer compiled
    without prepare_delayed_scaling runs its first call eagerly and then compiles, matching eager
    (torch 2.11's Dynamo failed on the graph break the newer path takes: the layers' frames are
    then compiled, the frame around them runs eagerly); fullgraph=True says to call
    prepare_delayed_scaling."""
    import torch

    from fp8shard.nn import Linear, linear

    monkeypatch.setattr(linear, "_STATE_IN_GRAPH_BREAKS_DYNAMO", True)
    compile_case("cpu", fs.DelayedScaling(amax_history_len=4), fp8_params)
    torch._dynamo.reset()  # a fresh Dynamo: nothing cached from the compiles above
    with fs.fp8_model_init(enabled=fp8_params):
        layer = Linear(64, 32)
    with pytest.raises(Exception, match=r"call fs\.nn\.prepare_delayed_scaling\(model, recipe\) before"), \
            fs.fp8_autocast(recipe=fs.DelayedScaling()):
        torch.compile(layer, fullgraph=True)(torch.randn(16, 64))

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

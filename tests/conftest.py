"""Shared fixtures. ``dist_pool`` is the one multi-process harness of the suite."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run only in Triton's interpreter (tests/triton_interp.py),
    # which must be on before triton.language is first imported: its own jit functions (tl.max,
    # tl.zeros, ...) are made then. `import torch` does not import triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fp8shard.testing import DistPool


def pools_fixture(backend: str = "auto"):
    """A module-scoped fixture: ``dist_pools(world_size)`` -> a DistPool shared by every test
    of the module (one set of worker processes per module and world size)."""

    @pytest.fixture(scope="module")
    def dist_pools():
        pools: dict[int, DistPool] = {}

        def get(world_size: int) -> DistPool:
            if world_size not in pools:
                pools[world_size] = DistPool(world_size, backend=backend)
            return pools[world_size]

        yield get
        for pool in pools.values():
            pool.close()

    return dist_pools


dist_pools = pools_fixture("auto")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the lent H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_device():
    return torch.device("cuda")


@pytest.fixture(autouse=True)
def _fp8_gemm_setting():
    """Each test starts on the default FP8 GEMM setting: an in-process training run settles it
    process-wide (``configure_compute``), which must not leak into the next test."""
    from fp8shard.fp8 import gemm

    gemm.set_fp8_gemm("auto")
    yield
    gemm.set_fp8_gemm("auto")


@pytest.fixture(autouse=True)
def _triton_setting():
    """Each test starts with the Triton kernels switched on (the default): a test or an
    in-process training run (``trainer.triton``) may switch them off process-wide."""
    import fp8shard

    fp8shard.set_triton(None)
    yield
    fp8shard.set_triton(None)

"""The checkpoint tests run their process pools on gloo with CPU tensors, even where GPUs are.

They compare resumed runs with uninterrupted ones bit for bit, and resharded runs with their
CPU reference; the tiny model is built on CPU. (NCCL needs the model on CUDA: a GPU run of
the same path is the training command's ``checkpoint.every_n_steps`` on the H200.)
"""

from __future__ import annotations

import pytest

from fp8shard.nn import autocast
from fp8shard.testing import DistPool


@pytest.fixture(scope="module")
def dist_pools():
    """``dist_pools(world_size)`` -> a gloo DistPool shared by every test of this module."""
    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools:
            pools[world_size] = DistPool(world_size, backend="gloo")
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(autouse=True)
def _no_pending_amaxes():
    """No delayed-scaling layers of an earlier test's model pending in this process."""
    autocast._pending.clear()
    yield
    autocast._pending.clear()

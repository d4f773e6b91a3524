"""The optimizer tests run on gloo even where GPUs are present.

They compare against ``torch.optim`` run on CPU tensors in the same process, bit for bit; on
NCCL the model and the reference would have to move to CUDA, whose kernels need not round like
the CPU ones. The GPU path is measured by ``benchmarks/bench_optim.py --gpu``.
"""

from __future__ import annotations

import pytest

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

"""The multi-process test harness itself: a worker that dies is reported at once, not waited for."""

from __future__ import annotations

import os
import time

import pytest

from fp8shard.testing import DistPool


def _exit_on_rank_1(code: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(code)
    return dist.get_rank()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_results_in_rank_order_then_a_dead_worker_is_an_error_not_a_hang():
    pool = DistPool(2, backend="gloo", timeout_s=120.0)
    try:
        assert pool.run(_rank) == [0, 1]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"_exit_on_rank_1: worker process\(es\) of rank\(s\) \[1\] "
                                               r"died \(exit codes \[7\]\)"):
            pool.run(_exit_on_rank_1, 7)
        assert time.monotonic() - start < 60  # found by polling, long before timeout_s
    finally:
        pool.close(force=True)

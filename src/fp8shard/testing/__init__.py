"""Helpers for tests and benchmarks: the multi-process pool and numerics metrics."""

from fp8shard.testing.dist import DistPool, pick_backend
from fp8shard.testing.metrics import sqnr_db

__all__ = ["DistPool", "pick_backend", "sqnr_db"]

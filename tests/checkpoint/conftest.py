"""The checkpoint tests run their process pools on gloo with CPU tensors, even where GPUs are.

They compare resumed runs with uninterrupted ones bit for bit, and resharded runs with their
CPU reference; the tiny model is built on CPU. (NCCL needs the model on CUDA: a GPU run of
the same path is the training command's ``checkpoint.every_n_steps`` on the H200.)
"""

from __future__ import annotations

from tests.conftest import pools_fixture

dist_pools = pools_fixture("gloo")

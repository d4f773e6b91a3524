"""The optimizer tests run on gloo even where GPUs are present.

They compare against ``torch.optim`` run on CPU tensors in the same process, bit for bit; on
NCCL the model and the reference would have to move to CUDA, whose kernels need not round like
the CPU ones. The GPU path is measured by ``benchmarks/bench_optim.py --gpu``.
"""

from __future__ import annotations

from tests.conftest import pools_fixture

dist_pools = pools_fixture("gloo")

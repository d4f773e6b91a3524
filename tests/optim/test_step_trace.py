"""How far one ``step()`` wanders: the source files of fp8shard it runs code in (issue 18).

One step of ``DistributedFusedAdam`` on FP8 (and bf16, fp32) parameters, with the fused step's
orchestration on the CPU (``step_kernel="fused"``: its PyTorch reference ops stand in for the
Triton kernels), traced with ``sys.setprofile``: every Python function called is attributed to
its file. Before the step kernel ([Note: step kernel]) the same step ran code in 13 files of
src/fp8shard (242 calls); now 10 (about 180 calls). On the GPU the reference ops (optim/adam.py,
fp8/cast.py) give way to optim/triton_adam.py.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

import fp8shard
from fp8shard.optim import DistributedFusedAdam
from tests.optim.dist_cases import TINY_BUCKET_MB, TinyMixed, batch

SRC = os.path.dirname(os.path.realpath(fp8shard.__file__))

# What one step touches, and why.
EXPECTED = {
    "optim/distributed_fused_adam.py",  # step(): the three phases
    "optim/hooks.py",  # finish the reduce-scatters; launch and wait for the gathers
    "optim/collectives.py",  # the collectives (and their byte counts)
    "optim/fused_step.py",  # the step kernel: tile tables, kernel 1 and 2
    "optim/adam.py",  # kernel 1's reference op (Triton on the GPU: optim/triton_adam.py)
    "fp8/cast.py",  # kernel 2's reference op
    "fp8/formats.py",  # the FP8 format of a region (its max, its dtype)
    "optim/fp8_weights.py",  # the scales from the global amax
    "fp8/scaling.py",  # the scale convention ([Note: scale])
    "fp8/tensor.py",  # the new scale_inv lands on the weight; its transpose cache is dropped
}
MAX_FILES = 10  # 13 before the step kernel


def _files_of_one_step(scaling: str, clip: bool) -> collections.Counter:
    torch.manual_seed(0)
    model = TinyMixed()
    opt = DistributedFusedAdam(model.parameters(), lr=2e-2, weight_decay=0.05,
                               bucket_cap_mb=TINY_BUCKET_MB, fp8_weight_scaling=scaling,
                               step_kernel="fused")
    model(batch(1, 0)).square().mean().backward()
    opt.step()  # the first step: nothing built lazily is counted below
    opt.zero_grad()
    model(batch(2, 0)).square().mean().backward()
    if clip:
        opt.clip_grad_norm(1e-3)
    files: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(SRC + os.sep):
                files[os.path.relpath(path, SRC).replace(os.sep, "/")] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(previous)
    assert not opt.last_step_skipped
    return files


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
def test_one_step_visits_at_most_ten_files(scaling, clip):
    files = _files_of_one_step(scaling, clip)
    assert len(files) <= MAX_FILES, dict(files)
    assert set(files) <= EXPECTED, dict(files)
    # Chosen once at construction: no step asks again whether Triton serves, or re-slices buffers.
    assert not {"_triton.py", "optim/layout.py", "optim/buffers.py"} & set(files)

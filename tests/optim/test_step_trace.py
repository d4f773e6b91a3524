"""How far one ``step()`` wanders: the source files of fp8shard it runs code in (issue 18).

One step of ``DistributedFusedAdam`` on FP8 (and bf16, fp32) parameters, with the fused step's
orchestration on the CPU (``step_kernel="fused"``: its PyTorch reference ops stand in for the
Triton kernels), traced with ``sys.setprofile``: every Python function called is attributed to
its file. Before the step kernel ([Note: step kernel]) the same step ran code in 13 files of
src/fp8shard (242 calls); with the step kernel 10 (about 180 calls); with the engine interface
([Note: engine]: core.py + flat.py for distributed_fused_adam.py + hooks.py, the reference Adam
op beside the kernel's other reference ops in fused_step.py) 9; with the FP8 formats' max and
dtype plain attributes and each region's format resolved when it is built, 8; with the per-tensor
weights cast through the quantizer protocol ([Note: quantizer]), still 8: fp8/quantizer.py, where
the scale rule and the amax history now live, in place of fp8/scaling.py; with the weights'
quantizers (``WeightQuantizers``: slots, scales, the new scale_inv onto the weights) and the
encoding (``cast_to_fp8``) in fp8/quantizer.py beside the per-tensor quantizers, and kernel 2's
reference op the per-tensor quantizer's ``cast_scaled``, 6 (about 180 calls): optim/fp8_weights.py
keeps only the flat engine's pieces (the reference kernel's), fp8/cast.py re-exports the
encoding. On the GPU the reference ops (``adam_``, the cast) give way to optim/triton_adam.py.

One step of ``FSDP2Adam`` (2 ranks, gloo) through the same core on the FSDP2 engine: 6 files (9
before the formats became constants; fp8/quantizer.py for fp8/scaling.py since the protocol; 8
before the weights' quantizers and the encoding joined it).
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

import fp8shard
from fp8shard.optim import DistributedFusedAdam
from tests.conftest import pools_fixture
from tests.optim.dist_cases import TINY_BUCKET_MB, TinyMixed, batch

SRC = os.path.dirname(os.path.realpath(fp8shard.__file__))

# What one step touches, and why.
EXPECTED = {
    "optim/core.py",  # step(): the three phases
    "optim/flat.py",  # the flat engine: finish the reduce-scatters; launch and wait for the gathers
    "optim/collectives.py",  # the collectives (and their byte counts)
    "optim/fused_step.py",  # the step kernel: tile tables, kernel 1 and 2, and their reference ops
    # the weights' quantizers: their scales from the global amax, kernel 2's reference cast
    # (cast_scaled, the encoding), the new scale_inv ([Note: quantizer], [Note: scale])
    "fp8/quantizer.py",
    "fp8/tensor.py",  # the new scale_inv lands on the weight; its transpose cache is dropped
}
# 13 before the step kernel, 10 before the engine interface, 9 before formats as constants, 8 before
# the weights' quantizers and the encoding joined fp8/quantizer.py (for optim/fp8_weights.py, fp8/cast.py)
MAX_FILES = 6

EXPECTED_FSDP2 = {
    "optim/core.py",  # step(): the three phases
    "optim/fsdp2.py",  # the FSDP2 engine and its kernel: local shards, amax, cast into the bytes
    "optim/fused_step.py",  # the reference kernel and its Adam op (adam_)
    "optim/collectives.py",  # the two all-reduces (and their byte counts)
    # the weights' quantizers: amax, scales from the global amax, the cast into the local bytes
    "fp8/quantizer.py",
    "fp8/tensor.py",  # the new scale_inv lands on the local shard
}
# 9 before the formats became constants (then fsdp2.py called dist itself), 8 before the weights'
# quantizers and the encoding joined fp8/quantizer.py (for optim/fp8_weights.py, fp8/cast.py)
MAX_FILES_FSDP2 = 6

dist_pools = pools_fixture("gloo")


def _trace(fn) -> collections.Counter:
    """The fp8shard files ``fn()`` runs Python code in, with their call counts."""
    files: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(SRC + os.sep):
                files[os.path.relpath(path, SRC).replace(os.sep, "/")] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return files


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
    files = _trace(opt.step)
    assert not opt.last_step_skipped
    return files


def fsdp2_files_of_one_step(scaling: str) -> dict[str, int]:
    """On every rank: the files of one FSDP2Adam step (the second; the first builds lazily)."""
    from tests.fsdp2 import cases

    cases.pin_gemm()
    torch.manual_seed(0)
    model = cases.shard(cases.make_model())
    opt = cases.make_opt(model, "fsdp2", scaling=scaling)
    cases.train_steps(model, opt, range(1))
    x, y = cases.batch(1)
    with fp8shard.fp8_autocast(enabled=True, recipe=fp8shard.DelayedScaling()), \
            torch.autocast(x.device.type, torch.bfloat16):
        model(x, y).backward()
    files = _trace(opt.step)
    assert not opt.last_step_skipped
    return dict(files)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
def test_one_step_visits_at_most_nine_files(scaling, clip):
    files = _files_of_one_step(scaling, clip)
    assert len(files) <= MAX_FILES, dict(files)
    assert set(files) <= EXPECTED, dict(files)
    # Chosen once at construction: no step asks again whether Triton serves, or re-slices buffers.
    assert not {"_triton.py", "optim/layout.py", "optim/buffers.py"} & set(files)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_one_fsdp2_step_visits_at_most_nine_files(dist_pools, scaling):
    for files in dist_pools(2).run(fsdp2_files_of_one_step, scaling):
        assert len(files) <= MAX_FILES_FSDP2, files
        assert set(files) <= EXPECTED_FSDP2, files

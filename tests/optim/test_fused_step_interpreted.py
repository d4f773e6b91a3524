"""The fused optimizer step's Triton kernels on the CPU, under Triton's interpreter
(``tests/triton_interp.py``): the GPU tests of ``test_fused_step.py`` with the kernels executed by
numpy, so CI checks their indexing, masks, per-tile amax, FP8 encoding, 16-bit stores and the
optimizer's use of them without a GPU; and that the optimizer's fused step is on by default and
switched by ``fused=`` and ``fp8shard.set_triton``."""

from __future__ import annotations

import pytest
import torch

import fp8shard
from fp8shard.optim import fused_step as fs
from tests.optim.test_fused_step import (
    LAYOUTS,
    _train,
    check_cast_keeps_nan_and_saturates,
    check_fp8_encoding,
    check_kernels,
    check_layout,
    check_slot_amax_keeps_nan_and_inf,
)
from tests.optim.test_fused_step_optimizer import _run_opt, assert_optimizers_close


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton kernels of ``triton_adam`` made interpreted (``tests/triton_interp.py``), serving
    CPU tensors whenever ``fp8shard.get_triton()`` allows (as ``use_triton`` does on CUDA)."""
    from fp8shard._triton import triton_enabled
    from fp8shard.optim import flat, triton_adam
    from tests.triton_interp import interpreted as interpreted_kernels

    with interpreted_kernels(monkeypatch, triton_adam):
        assert type(triton_adam._adam_kernel).__name__ == "InterpretedFunction"
        for mod in (fs, flat):
            monkeypatch.setattr(mod, "use_triton", lambda *tensors: triton_enabled())
        yield triton_adam


# The GPU test's layouts, the two largest at about a fifth of their elements (the interpreter runs
# each tile's numpy ops one program at a time: those two took 10-15 s per dtype), with what they
# are there for kept: several tensors and buckets with a partial last tile of the default tile
# size; tensors straddling the shards of 3 ranks, several tiles per shard.
INTERPRETED_LAYOUTS = [
    (1, 0, [7 * 13, 1200, 2048, 2049, 33, 1], 4096, 16, fs.DEFAULT_BLOCK),
    (3, 1, [30 * 77, 1000, 17, 9000, 5], 6144, 16, 512),
    *LAYOUTS[2:],
]


@pytest.mark.parametrize("layout", INTERPRETED_LAYOUTS, ids=lambda x: f"ws{x[0]}r{x[1]}a{x[4]}b{x[5]}")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32],
                         ids=str)
def test_interpreted_kernels_match_the_reference(layout, dtype, interpreted):
    fp8shard.set_triton(True)
    check_layout(layout, dtype, "cpu")


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_interpreted_kernels_with_16bit_states(state_dtype, interpreted):
    fp8shard.set_triton(True)
    for mode in ("current", "delayed"):
        check_kernels(3, 2, [5000, 77, 2048], torch.float8_e4m3fn, bucket=4096, align=16,
                      grad_dtype=torch.bfloat16, state_dtype=state_dtype, adam_w=True, mode=mode,
                      block=fs.DEFAULT_BLOCK, clip=False, device="cpu")


def test_interpreted_cast_keeps_nan_and_saturates(interpreted):
    fp8shard.set_triton(True)
    check_cast_keeps_nan_and_saturates("cpu")


def test_interpreted_slot_amax_keeps_nan_and_inf(interpreted):
    check_slot_amax_keeps_nan_and_inf("cpu")


def test_interpreted_cast_encodes_every_fp8_boundary(interpreted):
    """The GPU test's inputs with 4096 random bit patterns instead of 2M (interpreted)."""
    fp8shard.set_triton(True)
    check_fp8_encoding(4096, "cpu")


@pytest.mark.parametrize(("scaling", "state_dtype"),
                         [("current", torch.bfloat16), ("delayed", torch.float32)], ids=str)
def test_optimizer_with_interpreted_kernels_matches_without(scaling, state_dtype, interpreted):
    """``test_optimizer_with_triton_matches_without`` on the CPU, the kernels interpreted (the
    reference is then the CPU's Adam); two of its four cases, 4 steps of its 6 (the third
    skipped, one after it; 6 took 20-35 s each interpreted)."""
    pa, oa = _run_opt("1", 4, scaling, state_dtype, clip=0.5, device="cpu")
    pb, ob = _run_opt("0", 4, scaling, state_dtype, clip=0.5, device="cpu")
    assert oa.state_dict()["step"] == ob.state_dict()["step"] == 3
    assert_optimizers_close(pa, oa, pb, ob, state_dtype, lr=1e-2)


def test_fused_step_is_on_by_default_and_can_be_turned_off(interpreted):
    """Where Triton serves, the optimizer takes its fused step unless ``fused=False`` (or
    ``fp8shard.set_triton(False)``); a bad value is an error naming the argument."""
    assert fp8shard.get_triton() is True
    assert _train(None, steps=1)[1]._fused is not None
    assert _train(None, steps=1, fused=False)[1]._fused is None
    fp8shard.set_triton(False)
    assert fp8shard.get_triton() is False
    assert _train(None, steps=1, fused=True)[1]._fused is None
    fp8shard.set_triton(None)  # the default again
    assert fp8shard.get_triton() is True
    assert _train(None, steps=1, fused=True)[1]._fused is not None
    with pytest.raises(ValueError, match="fused must be True or False, got 'yes please'"):
        _train(None, steps=1, fused="yes please")
    with pytest.raises(ValueError, match="set_triton takes True, False or None"):
        fp8shard.set_triton("0")

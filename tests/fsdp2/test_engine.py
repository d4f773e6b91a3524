"""The FSDP2 engine against the flat engine: losses, bytes on the wire, memory, HSDP.

Multi-process gloo tests (tests/conftest.py's pool); the cases are in cases.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import pools_fixture
from tests.fsdp2 import cases

dist_pools = pools_fixture("gloo")

STEPS = 20


def test_losses_match_flat_engine_2_ranks(dist_pools):
    """Same model, data and optimizer math: on 2 ranks the FSDP2 engine's 20 losses are the flat
    engine's bit for bit (the same bf16 gradient average -- a sum of two is order-free --, the
    same elementwise Adam, the same global-amax scales)."""
    pool = dist_pools(2)
    flat = pool.run(cases.run_losses, "flat", STEPS)[0]
    fsdp2 = pool.run(cases.run_losses, "fsdp2", STEPS)[0]
    assert len(fsdp2) == STEPS
    assert fsdp2[-1] < fsdp2[0] - 1.0  # it trains
    assert fsdp2 == flat


def test_layers_computing_in_bf16_match_flat_engine(dist_pools):
    """Every layer out of FP8 compute, its weight FP8-stored: dequantized in the forward and
    again in the backward, from the bytes FSDP2 gathered again after resharding them at the
    forward's end. The same losses and states as the flat engine, bit for bit."""
    pool = dist_pools(2)
    flat, flat_digest = pool.run(cases.run_with_digest, "flat", 6, fp8_compute=False)[0]
    fsdp2, fsdp2_digest = pool.run(cases.run_with_digest, "fsdp2", 6, fp8_compute=False)[0]
    assert fsdp2[-1] < fsdp2[0] - 0.5
    assert fsdp2 == flat and fsdp2_digest == flat_digest
    assert fsdp2 != pool.run(cases.run_losses, "fsdp2", 6)[0]  # not the FP8-compute run


def test_losses_match_flat_engine_4_ranks(dist_pools):
    """On 4 ranks the gradient average sums 4 numbers, in an order that depends on the buffers
    each engine reduces; with fp32 gradients the engines agree bit for bit until such a rounding
    difference flips an FP8 byte, and stay within 0.2% over 20 steps."""
    pool = dist_pools(4)
    flat = pool.run(cases.run_losses, "flat", STEPS, params_dtype="fp32")[0]
    fsdp2 = pool.run(cases.run_losses, "fsdp2", STEPS, params_dtype="fp32")[0]
    assert fsdp2[:10] == flat[:10]
    assert fsdp2 == pytest.approx(flat, rel=2e-3)
    assert fsdp2[-1] < fsdp2[0] - 1.0


def test_losses_match_with_delayed_weight_scaling(dist_pools):
    """fp8_weight_scaling='delayed' (the weights' amax history): the same scaler, the same losses."""
    pool = dist_pools(2)
    flat = pool.run(cases.run_losses, "flat", 8, scaling="delayed")[0]
    fsdp2 = pool.run(cases.run_losses, "fsdp2", 8, scaling="delayed")[0]
    assert fsdp2 == flat
    assert fsdp2 != pool.run(cases.run_losses, "fsdp2", 8)[0]  # delayed differs from current


def test_losses_match_with_clipping(dist_pools):
    """With gradient clipping the norm is summed in another order (per parameter shard, not per
    bucket): the clip coefficients differ in the last bits, which may flip an FP8 byte; the
    losses agree to 0.2%."""
    pool = dist_pools(2)
    flat = pool.run(cases.run_losses, "flat", 8, clip=0.05)[0]
    fsdp2 = pool.run(cases.run_losses, "fsdp2", 8, clip=0.05)[0]
    assert fsdp2 == pytest.approx(flat, rel=2e-3)
    assert fsdp2 != pool.run(cases.run_losses, "fsdp2", 8)[0]  # the clipping did act


@pytest.mark.parametrize(("scaling", "clip"), [("current", 0.0), ("delayed", 0.0), ("current", 0.05)],
                         ids=["current", "delayed", "clipped"])
def test_fused_step_kernel_matches_reference_kernel(dist_pools, scaling, clip):
    """``step_kernel='fused'`` (FSDP2FusedKernel: the fused step's tile ops on each local shard,
    the bf16 gradient read in place, clipping as a coefficient; off CUDA its PyTorch tile ops)
    against ``'reference'`` (fp32 gradient copies): the same losses and, after 8 steps, every
    master, moment, FP8 byte and scale hashing alike. With clipping the norm is summed from
    the bf16 shards instead of their fp32 copies, which may move the coefficient's last bit:
    there, to 0.2%."""
    pool = dist_pools(2)
    ref, ref_digest = pool.run(cases.run_with_digest, "fsdp2/reference", 8, clip=clip, scaling=scaling)[0]
    fused, fused_digest = pool.run(cases.run_with_digest, "fsdp2/fused", 8, clip=clip, scaling=scaling)[0]
    assert ref[-1] < ref[0] - 1.0
    if clip:
        assert fused == pytest.approx(ref, rel=2e-3)
    else:
        assert fused == ref
        assert fused_digest == ref_digest


def test_step_kernel_choice(dist_pools):
    """'auto' takes the reference kernel off CUDA (no Triton there) and for tiled weights;
    'fused' refuses rowwise weights, naming the fix; an unknown name is refused."""
    pool = dist_pools(2)
    assert pool.run(cases.step_kernel_name, "fsdp2")[0] == "FSDP2Kernel"
    assert pool.run(cases.step_kernel_name, "fsdp2/fused")[0] == "FSDP2FusedKernel"
    with pytest.raises(Exception, match=r"per-tensor FP8 weights only.*step_kernel='reference' or 'auto'"):
        pool.run(cases.step_kernel_name, "fsdp2/fused", "rowwise")
    with pytest.raises(Exception, match="step_kernel must be 'auto', 'reference' or 'fused'"):
        pool.run(cases.step_kernel_name, "fsdp2/triton")


def test_hsdp_2x2_matches_flat_engine(dist_pools):
    """HSDP on 4 ranks (2 replicas x 2 shards): the replicas hold identical shards, bytes and
    master; with fp32 gradients the losses are the flat engine's on 4 ranks to fp32 rounding for
    the first steps (the gradient average sums in two stages), and to 0.2% once a last-bit
    difference has flipped an FP8 byte."""
    pool = dist_pools(4)
    flat = pool.run(cases.run_losses, "flat", 10, params_dtype="fp32")[0]
    hsdp = pool.run(cases.run_losses, "fsdp2", 10, replicate=2, params_dtype="fp32")[0]
    assert hsdp[:3] == pytest.approx(flat[:3], rel=1e-6)
    assert hsdp == pytest.approx(flat, rel=2e-3)
    assert all(pool.run(cases.hsdp_shards_agree))


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_moves_one_byte_per_fp8_weight(dist_pools, world):
    """Counted on the wire: the parameter all-gathers move uint8 FP8 bytes, 1 B per weight
    element per gather (a bf16 round trip would be 2), and the gradients travel in bf16."""
    r = dist_pools(world).run(cases.wire_bytes)[0]
    assert r["keys"] == ["all_gather.params.uint8", "reduce_scatter.grads.float32"]  # fp32 weights
    assert r["bytes_per_elem_per_step"] <= 1.01
    assert r["bytes_per_elem_per_step"] == pytest.approx(1.0)
    # The optimizer's comm_report counts the same gathers (its window: the last step).
    assert r["report"]["all_gather.params.uint8"] == pytest.approx(r["bytes_per_elem_per_step"] * r["n"])


def test_reshard_after_forward_gathers_twice(dist_pools):
    """With reshard_after_forward (the default) backward gathers again: 2 B per element per step,
    still FP8 bytes."""
    r = dist_pools(2).run(cases.wire_bytes, reshard_after_forward=True)[0]
    assert r["keys"][0] == "all_gather.params.uint8"
    assert 1.0 < r["bytes_per_elem_per_step"] <= 2.02


@pytest.mark.parametrize("world", [2, 4])
def test_persistent_memory_per_fp8_weight(dist_pools, world):
    """Per FP8 weight element and rank: 1/N FP8 byte, 2/N bf16 gradient, 4/N master, 8/N Adam
    states -- 15/N, within the target 1 + 2 + 12/N (+ the gradient shard); the gathered bytes
    are freed after backward."""
    for r in dist_pools(world).run(cases.memory_per_fp8_elem):
        n = r["world"]
        assert r["weights"] == pytest.approx(1 / n, rel=0.02)
        assert r["report_fp8_weights"] == pytest.approx(r["weights"])
        assert r["grads"] == pytest.approx(2 / n, rel=0.02)
        assert r["master"] + r["states"] == pytest.approx(12 / n, rel=0.02)
        total = r["weights"] + r["grads"] + r["master"] + r["states"]
        assert total <= 1 + 2 + 12 / n + r["grads"]
        assert r["unsharded_bytes"] == 0


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_fused_kernel_skip_decided_on_the_device_matches_the_host(dist_pools, scaling):
    """[Note: skip on the device] on the FSDP2 engine (2 ranks): a NaN gradient at step 3 skips
    the step on every rank and leaves every master, moment, FP8 byte and scale as it was; with the
    decision read on the host first, every step's state is the same, and both count 4 steps."""
    pool = dist_pools(2)
    dev, dev_skipped, dev_steps = pool.run(cases.skip_digests, True, scaling)[0]
    host, host_skipped, host_steps = pool.run(cases.skip_digests, False, scaling)[0]
    assert dev_skipped == host_skipped == [False, False, True, False, False]
    assert dev_steps == host_steps == 4
    assert dev[2] == dev[1] and dev[3] != dev[2]
    assert dev == host

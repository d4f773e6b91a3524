"""DistributedFusedAdam on 1-4 gloo ranks against torch.optim.AdamW on the averaged gradients.

All cases live in dist_cases.py (the workers import them). One pool per world size serves the
whole module, so the process start-up is paid once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.optim import dist_cases as dc
from tests.optim.dist_cases import Case


def _train(dist_pools, world_size: int, case: Case) -> list[dict]:
    results = dist_pools(world_size).run(dc.run_training, case)
    # Identical weights (FP8 bytes and scales included) and identical state on every rank.
    assert len({r["params"] for r in results}) == 1
    assert len({r["state"] for r in results}) == 1
    return results


@pytest.mark.parametrize("world_size", [1, 2])
def test_bit_identical_to_torch_adamw(dist_pools, world_size):
    # fp32 gradient sync, tiny buckets (parameters straddle buckets and shards), FP8 + bf16 +
    # fp32 parameters, odd shapes, unused parameters, a preserved high-precision init value.
    _train(dist_pools, world_size, Case(exact=True))


def test_bit_identical_to_torch_adam_with_l2(dist_pools):
    _train(dist_pools, 2, Case(exact=True, adam_w_mode=False))


@pytest.mark.parametrize("world_size", [3, 4])
def test_matches_torch_adamw_at_any_world_size(dist_pools, world_size):
    # With 3 or 4 ranks gloo sums the gradients in its own order: equal up to rounding.
    _train(dist_pools, world_size, Case(alignment=16))


def test_parameter_unused_on_one_rank_only(dist_pools):
    # Rank 0 completes its buckets in another order than the others; launches stay in one order.
    _train(dist_pools, 3, Case(skip_on_rank0=True))


def test_a_parameter_without_a_gradient_after_one_with_counts_as_zero(dist_pools):
    # [Note: lazy gradient zeroing]: gamma's slot still holds step 1's gradient when step 2 gives
    # it none; the step must read zero there, as the reference does.
    _train(dist_pools, 2, Case(skip_at_step=2, steps=3))


def test_param_groups(dist_pools):
    _train(dist_pools, 3, Case(groups=True, alignment=4))


def test_default_bf16_grads_and_bf16_states(dist_pools):
    results = _train(dist_pools, 2, Case(grad_sync_dtype=torch.bfloat16, state_dtype=torch.bfloat16,
                                          bucket_cap_mb=25.0, alignment=16))
    assert results[0]["comm"]["reduce_scatter.grads"] % 2 == 0


def test_delayed_weight_scaling(dist_pools):
    # Each cast uses the scale from the amax history before it (checked in dist_cases).
    _train(dist_pools, 2, Case(exact=True, scaling="delayed", steps=4))


def test_overlap_options_are_bit_identical(dist_pools):
    base = Case(steps=3)
    runs = [dataclasses.replace(base, overlap_grad_sync=g, overlap_param_sync=p)
            for g in (True, False) for p in (True, False)]
    digests = {(r := _train(dist_pools, 3, c)[0])["params"] + r["state"] for c in runs}
    assert len(digests) == 1


def test_bucket_size_and_alignment_do_not_change_results(dist_pools):
    runs = [Case(bucket_cap_mb=b, alignment=a) for b in (dc.TINY_BUCKET_MB, 40 * 4 / 2**20, 25.0)
            for a in (1, 16)]
    digests = {(r := _train(dist_pools, 2, c)[0])["params"] + r["state"] for c in runs}
    assert len(digests) == 1


def test_gradient_accumulation(dist_pools):
    # Exact: k micro-batches under no_sync == AdamW on the sum of their gradients (same order).
    micro = _train(dist_pools, 2, Case(exact=True, micro=3, rows=4))[0]
    # To rounding: == one batch of 3x the rows (the sum over rows is grouped differently).
    big = _train(dist_pools, 2, Case(exact=True, micro=1, rows=12))[0]
    # Adam divides by sqrt(v): where a gradient is near zero an ulp of it moves the update by a
    # visible fraction, so the bound is on the update size (lr = 2e-2): 0.5% of one step.
    for a, b in zip(micro["masters"], big["masters"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_clip_grad_norm_matches_torch(dist_pools):
    _train(dist_pools, 3, Case(clip=0.05))


def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(dist_pools):
    results = _train(dist_pools, 2, Case(exact=True, nan_at_step=2, steps=3))
    assert all(r["skipped"] == [False, True, False] for r in results)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_on_the_wire_and_memory(dist_pools, world_size):
    alignment = 16
    results = dist_pools(world_size).run(dc.wire_and_memory, alignment)
    r = results[0]
    comm, mem = r["comm"], r["memory"]
    # Parameter all-gather: one byte per FP8 weight element, plus padding.
    fp8_wire = comm["all_gather.params.float8_e4m3fn"]
    fp8_pad = fp8_wire - r["fp8_numel"]
    assert 0 <= fp8_pad < world_size * alignment * 4  # at most one quantum per FP8 param (3) + tail
    print(f"\nworld {world_size}: FP8 all-gather {fp8_wire} B for {r['fp8_numel']} elements "
          f"(padding {fp8_pad} B, {100 * fp8_pad / fp8_wire:.1f}%)")
    assert comm["all_gather.params.bfloat16"] >= 2 * r["other_numel"]["torch.bfloat16"]
    assert comm["all_gather.params.float32"] >= 4 * r["other_numel"]["torch.float32"]
    # Reduce-scatter: grad_sync_dtype (bf16) bytes for every element, padding included.
    padded = fp8_wire + comm["all_gather.params.bfloat16"] // 2 + comm["all_gather.params.float32"] // 4
    assert comm["reduce_scatter.grads"] == 2 * padded
    assert comm["all_reduce.amax"] == 4 * 3  # ONE packed all-reduce for the 3 FP8 weights
    # The memory report accounts for exactly the storages that exist between the backward and
    # the step (weights included); after the step the gradient storage is released.
    assert mem["total"] == r["storage_bytes"]
    assert r["grad_bytes_after_step"] == 0
    n_bf16, n_fp32 = r["other_numel"]["torch.bfloat16"], r["other_numel"]["torch.float32"]
    assert mem["fp8_weights"] == r["fp8_numel"]  # 1 byte per element
    assert mem["other_weights"] == 2 * n_bf16 + 4 * n_fp32
    assert mem["grad_buffers"] == 2 * r["numel"]  # bf16 gradients
    # master + exp_avg + exp_avg_sq: 12 bytes per element of this rank's 1/N of the buckets.
    assert mem["master"] + mem["optimizer_states"] <= 12 * padded / world_size
    pad = padded - r["numel"]
    assert mem["total"] <= (3 * r["fp8_numel"] + 4 * n_bf16 + 6 * n_fp32 + 12 * padded / world_size
                            + 6 * pad)
    # The baseline (bf16 weights, fp32 grads: 2 + 4 + 12/N per element) costs more.
    base = dist_pools(world_size).run(dc.wire_and_memory, alignment, False)[0]
    assert base["memory"]["total"] == base["storage_bytes"]
    assert base["memory"]["fp8_weights"] == 0 and base["memory"]["grad_buffers"] == 4 * r["numel"]
    saved = base["memory"]["total"] - mem["total"]
    # 1 (weight) + 2 (grad) bytes saved per FP8 element, 2 (grad) per other element, less the
    # padding of the extra (FP8) region.
    assert saved + mem["padding"] >= 3 * r["fp8_numel"] + 2 * (n_bf16 + n_fp32)
    print(f"memory per rank: FP8 {mem['total']} B vs bf16 baseline {base['memory']['total']} B")


def test_state_dict_reshards_across_world_sizes(dist_pools, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    saved = dist_pools(2).run(dc.save_after_training, path, 3)
    assert len(set(saved)) == 1
    for world_size in (3, 1):
        loaded = dist_pools(world_size).run(dc.load_and_resave, path)
        assert {r["digest"] for r in loaded} == {saved[0]}
        assert len({r["params"] for r in loaded}) == 1


def test_process_group_without_this_rank_is_refused(dist_pools):
    out = dist_pools(3).run(dc.construct_outside_group)
    assert out[:2] == ["member", "member"]
    assert "not a member" in out[2] and "process_group" in out[2]


def test_with_fp8shard_nn_linear(dist_pools):
    fs = pytest.importorskip("fp8shard")
    if not hasattr(fs, "fp8_model_init") or not hasattr(fs, "nn"):
        pytest.skip("fp8shard.nn is not there yet")
    digests = dist_pools(2).run(dc.train_fp8_linears, 3)
    assert len(set(digests)) == 1


def test_reduce_scatter_avg_and_its_sum_fallback_agree(dist_pools):
    results = dist_pools(2).run(dc.reduce_scatter_paths)
    for rank, (avg, fallback, counted) in enumerate(results):
        expected = [1.5 * (4 * rank + i) for i in range(4)]  # mean of x and 2x
        assert avg == fallback == expected
        assert counted == {"test": 2 * 8 * 4}  # two calls, 8 fp32 elements each

"""[Note: shard layout] on its own: no tensors, no process group."""

from __future__ import annotations

import itertools

import pytest

from fp8shard.optim.layout import ParamSpec, build_layout


def _specs(sizes, key="a"):
    return [ParamSpec(i, n, key) for i, n in enumerate(sizes)]


def _check_invariants(region, world_size, alignment):
    quantum = world_size * alignment
    # Buckets tile the region exactly; each splits evenly into aligned shards.
    assert region.buckets[0].start == 0
    for a, b in itertools.pairwise(region.buckets):
        assert a.end == b.start
    for b in region.buckets:
        assert b.numel % quantum == 0 and b.numel > 0
        assert b.shard_numel % alignment == 0
    # Parameters are aligned, in order, disjoint and inside the region.
    for p in region.params:
        assert p.start % alignment == 0
    for a, b in itertools.pairwise(region.params):
        assert a.end <= b.start
    assert region.params[-1].end <= region.numel
    # The pieces of all ranks cover every parameter element exactly once, and each rank's pieces
    # index its concatenated shard consistently.
    covered = {p.index: [0] * p.numel for p in region.params}
    starts = {p.index: p.start for p in region.params}
    for rank in range(world_size):
        local_seen = set()
        for pc in region.pieces(rank):
            b = region.buckets[pc.bucket]
            lo = b.shard_start(rank)
            assert lo <= pc.region_offset and pc.region_offset + pc.numel <= lo + b.shard_numel
            assert pc.region_offset == starts[pc.param_index] + pc.param_offset
            assert pc.local_offset == region.local_bucket_offset(pc.bucket) + pc.region_offset - lo
            for k in range(pc.numel):
                covered[pc.param_index][pc.param_offset + k] += 1
                assert pc.local_offset + k not in local_seen
                local_seen.add(pc.local_offset + k)
        assert all(0 <= x < region.shard_numel for x in local_seen)
    assert all(c == 1 for cs in covered.values() for c in cs)
    assert region.padding_numel == region.numel - sum(p.numel for p in region.params)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("alignment", [1, 4, 16])
@pytest.mark.parametrize("bucket_numel", [1, 40, 97, 10_000])
def test_layout_invariants(world_size, alignment, bucket_numel):
    sizes = [91, 7, 1, 0, 64, 13, 300, 5]
    (region,) = build_layout(_specs(sizes), world_size, bucket_numel, alignment)
    _check_invariants(region, world_size, alignment)


def test_params_straddle_buckets_and_shards():
    (region,) = build_layout(_specs([10, 10, 10]), world_size=2, bucket_numel=8, alignment=1)
    assert [(b.start, b.end) for b in region.buckets] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    assert region.buckets_of(region.params[1]) == [1, 2]
    # rank 1 owns [4, 8) of bucket 0: all in param 0; and [12, 16) of bucket 1: param 1 at 2..6.
    r1 = region.pieces(1)
    assert (r1[0].param_index, r1[0].param_offset, r1[0].numel, r1[0].local_offset) == (0, 4, 4, 0)
    assert (r1[1].param_index, r1[1].param_offset, r1[1].numel, r1[1].local_offset) == (1, 2, 4, 4)
    assert region.padding_numel == 0
    assert region.shard_numel == 15


def test_alignment_gaps_count_as_padding():
    (region,) = build_layout(_specs([7, 13]), world_size=3, bucket_numel=10_000, alignment=16)
    assert [p.start for p in region.params] == [0, 16]
    assert region.numel == 48  # 29 rounded up to a multiple of 3 * 16
    assert region.padding_numel == 48 - 20


def test_regions_by_key_in_first_appearance_order():
    specs = [ParamSpec(0, 5, "bf16"), ParamSpec(1, 6, "fp8"), ParamSpec(2, 7, "bf16")]
    regions = build_layout(specs, world_size=2, bucket_numel=100, alignment=1)
    assert [r.key for r in regions] == ["bf16", "fp8"]
    assert [p.index for p in regions[0].params] == [0, 2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        build_layout(_specs([3]), world_size=0, bucket_numel=10)
    with pytest.raises(ValueError, match="alignment"):
        build_layout(_specs([3]), world_size=2, bucket_numel=10, alignment=0)

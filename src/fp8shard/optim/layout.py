"""Where every parameter element lives in the optimizer's buffers. Pure arithmetic, no tensors.

[Note: shard layout]
    Parameters of one storage dtype (a *region*) are laid back to back in backward order, each
    starting at a multiple of ``alignment`` elements (so FP8 weights start 16-byte aligned, as
    ``torch._scaled_mm`` wants). The region is cut into buckets of ``bucket_numel`` elements; the
    last bucket is padded so its size is a multiple of ``world_size * alignment`` too. Each bucket
    splits into ``world_size`` equal shards and rank r owns shard r. A parameter may straddle
    shards and buckets: it stays one contiguous view of the region's buffer, while the optimizer
    sees it as one or more *pieces* (a parameter x shard intersection).

    A parameter with a ``unit`` > 1 (an FP8 weight scaled per row or per 128x128 block: a row,
    or a band of 128 rows, [Note: Float8Tensor]) must not be cut inside a unit, so that every
    rank casts whole tiles from its own master ([Note: tiled weight casts]). Such parameters get
    regions of their own, one per (key, unit), whose alignment is ``lcm(alignment, unit)``: each
    parameter starts on it, so its units do, and so does every shard boundary. A parameter
    shorter than its unit (fewer than 128 rows) gets ``unit = numel`` and lies in one shard.

Everything here is plain dataclasses so it can be tested without a process group
(tests/optim/test_layout.py) and reasoned about on paper.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter."""

    index: int
    """The parameter's position in the optimizer (flattened over param groups)."""
    numel: int
    region_key: Hashable
    """Parameters with equal keys share buffers (the storage dtype, e.g. ``torch.float8_e4m3fn``)."""
    unit: int = 1
    """Elements no shard boundary may cut (a row or a 128-row band of a tiled FP8 weight)."""


@dataclasses.dataclass(frozen=True)
class ParamRange:
    """One parameter's elements ``[start, start + numel)`` in its region."""

    index: int
    start: int
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Region elements ``[start, end)``, reduced and gathered by one collective each."""

    index: int
    start: int
    end: int
    world_size: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    def shard_start(self, rank: int) -> int:
        """Region offset of rank ``rank``'s shard of this bucket."""
        return self.start + rank * self.shard_numel


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """The part of parameter ``param_index`` that lies in ``rank``'s shard of bucket ``bucket``."""

    param_index: int
    bucket: int
    param_offset: int
    """Offset of the piece inside the flattened parameter."""
    region_offset: int
    """Offset of the piece in the region buffer."""
    local_offset: int
    """Offset of the piece in this rank's concatenated shards (master, exp_avg, ...)."""
    numel: int


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """Parameters, buckets and padding of one region. See [Note: shard layout]."""

    key: Hashable
    params: tuple[ParamRange, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    unit: int = 1
    """The unit of its parameters; shard boundaries fall on multiples of it."""

    @property
    def numel(self) -> int:
        """Elements of the region buffer, padding included."""
        return self.buckets[-1].end if self.buckets else 0

    @property
    def param_numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def padding_numel(self) -> int:
        """Alignment gaps between parameters plus the tail padding of the last bucket."""
        return self.numel - self.param_numel

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns over all buckets (the length of its master shard)."""
        return self.numel // self.world_size

    def local_bucket_offset(self, bucket: int) -> int:
        """Offset of bucket ``bucket``'s shard in a rank's concatenated shards."""
        return self.buckets[bucket].start // self.world_size

    def pieces(self, rank: int) -> list[ShardPiece]:
        """Every (parameter x shard) intersection owned by ``rank``, in region order."""
        out: list[ShardPiece] = []
        i = 0
        for b in self.buckets:
            lo = b.shard_start(rank)
            hi = lo + b.shard_numel
            local = self.local_bucket_offset(b.index)
            while i < len(self.params) and self.params[i].end <= lo:
                i += 1
            j = i
            while j < len(self.params) and self.params[j].start < hi:
                p = self.params[j]
                s, e = max(p.start, lo), min(p.end, hi)
                if e > s:
                    out.append(ShardPiece(p.index, b.index, s - p.start, s, local + s - lo, e - s))
                j += 1
        return out

    def buckets_of(self, param: ParamRange) -> list[int]:
        """Indices of the buckets a parameter's elements fall in."""
        return [b.index for b in self.buckets if b.start < param.end and param.start < b.end]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_layout(
    specs: Sequence[ParamSpec],
    world_size: int,
    bucket_numel: int,
    alignment: int = 16,
    region_numel: int | None = None,
) -> list[RegionLayout]:
    """Regions in order of first appearance in ``specs`` (which should be backward order).

    ``bucket_numel`` is rounded down to a multiple of ``world_size * alignment`` (at least one
    such multiple; ``lcm(alignment, unit)`` for parameters with a unit) so that every shard
    starts aligned. ``region_numel`` (None: no limit) caps a region's elements: the parameters
    of one key are cut, between parameters, into consecutive regions of at most that many
    elements (a larger parameter gets a region of its own), [Note: gradient regions].
    """
    if region_numel is not None and region_numel < 1:
        raise ValueError(f"region_numel must be >= 1, got {region_numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    by_key: dict[tuple[Hashable, int], list[ParamSpec]] = {}
    for s in specs:
        if s.numel < 0:
            raise ValueError(f"parameter {s.index} has negative numel {s.numel}")
        if s.unit < 1:
            raise ValueError(f"parameter {s.index} has unit {s.unit}; a unit is >= 1 element")
        by_key.setdefault((s.region_key, s.unit), []).append(s)
    regions = []
    for (key, unit), members in by_key.items():
        align = math.lcm(alignment, unit)  # units, and so shard boundaries, on multiples of it
        quantum = world_size * align
        cap = max(quantum, bucket_numel // quantum * quantum)
        for group in _split(members, align, region_numel):
            ranges, cursor = [], 0
            for s in group:
                cursor = _round_up(cursor, align)
                ranges.append(ParamRange(s.index, cursor, s.numel))
                cursor += s.numel
            total = _round_up(max(cursor, 1), quantum)
            buckets, start = [], 0
            while start < total:
                end = min(start + cap, total)
                buckets.append(Bucket(len(buckets), start, end, world_size))
                start = end
            regions.append(RegionLayout(key, tuple(ranges), tuple(buckets), world_size, unit))
    return regions


def _split(members: list[ParamSpec], align: int, limit: int | None) -> list[list[ParamSpec]]:
    """Consecutive runs of ``members`` whose aligned extent is at most ``limit`` elements (a
    parameter larger than it alone); one run when ``limit`` is None."""
    if limit is None:
        return [members]
    runs: list[list[ParamSpec]] = []
    cursor = 0
    for s in members:
        start = _round_up(cursor, align)
        if runs and runs[-1] and start + s.numel > limit:
            runs.append([])
            start = 0
        if not runs:
            runs.append([])
        runs[-1].append(s)
        cursor = start + s.numel
    return runs

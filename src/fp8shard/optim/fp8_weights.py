"""The FP8 weights' quantizers on the flat engine: each region's pieces, as their quantizers see them.

``Fp8WeightScaler`` is ``WeightQuantizers`` (``fp8/quantizer.py``: the weights' slots, their
quantizers, the scales from the global amax, the new ``scale_inv`` onto the weights; [Note:
weight scaling]) with the stats and casts of the flat engine's regions, which its reference
kernel runs (``FlatReferenceKernel``): every piece of this rank's master shard through its
weight's quantizer, ``local_stats`` and ``cast_scaled`` into the piece's bytes. The fused kernel
computes the same amaxes and bytes in its own passes ([Note: fused step]).

[Note: tiled weight casts]
    A rowwise or blockwise weight (``Float8Tensor.block``) has one slot per tile of its scale
    grid, after the per-tensor slots, and goes through its recipe's ``Quantizer``
    ([Note: quantizer]): ``local_stats`` of each of this rank's pieces, ``reduce`` (the same
    packed all-reduce MAX of every slot the optimizer runs for per-tensor weights), ``cast``
    of each piece into its bytes with the reduced stats. The layout cuts such weights only
    between rows or 128-row bands ([Note: shard layout]), so a piece is whole tiles: its
    stats are final on the rank that owns it (the others contribute 0, so the MAX only merges
    them: no partial tile is ever combined) and its cast needs no other rank's data. Every
    rank ends with every tile's amax, hence the same scales, so the bytes gathered from all
    ranks and the scale grid set on each rank form one consistent tensor: the scales travel as
    these amaxes, 4 bytes per row (rowwise) or per 128x128 block, beside the bytes' all-gather.
    A per-tensor weight is seen the same way, as one row of ``numel`` elements with one tile:
    its pieces are parts of that tile, which the MAX combines.
    Neighbouring tiled pieces of one row length and kind of tile (the layout keeps a region's
    weights of one shape together) are joined into one 2-D view when the first ends on a
    tile-row boundary: a tile's stats and bytes depend on its own elements only, so one call
    computes what the pieces' calls did; the plan's slot index puts their tiles' scales in
    that order (one gather per region for the cast).
    Scales are current (the tile's amax of the new master; a zero or non-finite amax gives
    scale 1) and plain (``power_of_2_scales`` is not applied to stored weights); delayed
    weight scaling is per-tensor only. The fused step ([Note: fused step]) is per-tensor only:
    with a tiled weight ``step_kernel='auto'`` takes the reference kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp8shard.fp8 import DelayedScaling, Float8Tensor, Fp8Format
from fp8shard.fp8.quantizer import Quantizer, ScalingMode, WeightQuantizers
from fp8shard.optim.buffers import RegionBuffers


class _Piece(NamedTuple):
    """One piece of this rank's master shard of one or more weights, as their quantizer sees it."""

    quantizer: Quantizer
    fmt: Fp8Format
    local: slice
    """Its elements in the region's master (this rank's shard)."""
    out: slice
    """Its elements in the region's parameter buffer (the bytes)."""
    cols: int
    """Row length of its 2-D view (whole rows of a tiled weight; the piece itself, per tensor)."""
    slots: tuple[range, ...]
    """The slots of its tiles, in the order of its 2-D view's tiles (a run per weight)."""
    at: slice
    """Its tiles' stats and scales in the region's slot order (the plan's index)."""
    grid: tuple[int, int]
    """Its tiles' scale grid."""
    band: int
    """Rows per tile of a tiled weight (rowwise 1, blockwise 128); 0 per tensor."""


class Fp8WeightScaler(WeightQuantizers):
    """``WeightQuantizers`` on the flat engine's regions: the stats and the casts of each
    region's pieces, each through its weight's quantizer ([Note: tiled weight casts])."""

    def __init__(self, params: dict[int, Float8Tensor], mode: ScalingMode,
                 recipe: DelayedScaling | None, device: torch.device) -> None:
        super().__init__(params, mode, recipe, device)
        self._plans: dict[int, tuple[list[_Piece], torch.Tensor]] = {}

    def _plan(self, rb: RegionBuffers) -> tuple[list[_Piece], torch.Tensor]:
        """``rb``'s pieces as their quantizers see them (neighbouring tiled ones joined), and the
        slot of each of their tiles in piece order (built once)."""
        key = id(rb)
        if key not in self._plans:
            pieces: list[_Piece] = []
            for pc in rb.pieces:
                i = pc.param_index
                cols, br, gc, _ = self._geometry[i]
                width = max(min(cols, pc.numel), 1)  # tiled: whole rows ([Note: tiled weight casts])
                first = self.span[i][0] + pc.param_offset // (cols * br) * gc
                grid = (-(-(pc.numel // width) // br), gc)
                piece = _Piece(self.quantizer(i), self._fmt[i],
                               slice(pc.local_offset, pc.local_offset + pc.numel),
                               slice(pc.region_offset, pc.region_offset + pc.numel), width,
                               (range(first, first + grid[0] * grid[1]),), slice(0), grid,
                               br if i in self.tiled else 0)
                if pieces and _joins(pieces[-1], piece):
                    a = pieces[-1]
                    piece = a._replace(local=slice(a.local.start, piece.local.stop),
                                       out=slice(a.out.start, piece.out.stop), slots=a.slots + piece.slots,
                                       grid=(a.grid[0] + piece.grid[0], a.grid[1]))
                    pieces.pop()
                pieces.append(piece)
            n = 0
            for k, p in enumerate(pieces):
                tiles = sum(len(r) for r in p.slots)
                pieces[k] = p._replace(at=slice(n, n + tiles))
                n += tiles
            idx = [s for p in pieces for r in p.slots for s in r]
            self._plans[key] = (pieces, torch.tensor(idx, dtype=torch.long, device=rb.master.device))
        return self._plans[key]

    def local_amax(self, regions: list[RegionBuffers]) -> torch.Tensor:
        """Per-slot stats of this rank's pieces (0 where it owns none): each piece's
        ``local_stats``, merged per slot by MAX (a per-tensor weight's pieces share its slot)."""
        out = torch.zeros(self.num_slots, dtype=torch.float32, device=self.scale.device)
        for rb in regions:
            if not rb.is_fp8 or not rb.pieces:
                continue
            pieces, idx = self._plan(rb)
            stats = [p.quantizer.local_stats(rb.master[p.local].view(-1, p.cols), "weight").reshape(-1)
                     for p in pieces]
            out.scatter_reduce_(0, idx, torch.cat(stats), reduce="amax")
        return out

    def cast_region(self, rb: RegionBuffers, scales: torch.Tensor) -> None:
        """Quantize this rank's master shard of an FP8 region into its shards of the bytes: each
        piece through its quantizer's ``cast_scaled``, with its tiles' scales (gathered into the
        plan's order once per region)."""
        pieces, idx = self._plan(rb)
        mine = scales[idx]
        for p in pieces:
            p.quantizer.cast_scaled(rb.master[p.local].view(-1, p.cols), mine[p.at].view(p.grid), p.fmt,
                                    "weight", out=rb.param_buffer[p.out].view(-1, p.cols))


def _joins(a: _Piece, b: _Piece) -> bool:
    """Whether ``b`` continues ``a`` as one 2-D view for their quantizer ([Note: tiled weight
    casts]): both tiled alike (quantizer, format, row length, tile grid columns), adjacent in the
    master and the bytes, ``a`` ending on a tile-row boundary. Each tile's stats and bytes are
    its own, so the joined view's stats and cast are the pieces', in one call where they were
    one each."""
    same = (a.quantizer, a.fmt, a.cols, a.grid[1], a.band) == (b.quantizer, b.fmt, b.cols, b.grid[1], b.band)
    return (a.band > 0 and same
            and a.local.stop == b.local.start and a.out.stop == b.out.start
            and (a.local.stop - a.local.start) // a.cols == a.grid[0] * a.band)


__all__ = ["Fp8WeightScaler", "ScalingMode", "WeightQuantizers"]

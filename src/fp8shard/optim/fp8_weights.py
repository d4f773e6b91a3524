"""FP32 master shard -> FP8 bytes of the same shard, with one scale per parameter or per tile.

[Note: weight scaling] (docs/design.md): every rank computes the amax of its slices of each FP8
parameter, ONE packed all-reduce(MAX) gives the global amaxes, and every rank derives the same
scales from them, so the shards it casts form one consistent tensor after the all-gather.

* ``current`` (default): the cast at step t uses ``scale = fmt.max / global_amax(master_t)``
  (guards of ``scale_from_amax``: zero or non-finite amax keeps the previous scale).
* ``delayed`` (Transformer Engine's recipe, for parity with the anchors): the cast at step t uses
  the scale computed from the amax history *before* step t; the global amax of master_t is then
  recorded and the scale for step t+1 computed from the window.

The optimizer talks to FP8 through this class only: slots, amaxes, scales, and a cast into bytes.

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
    Scales are current (the tile's amax of the new master; a zero or non-finite amax gives
    scale 1) and plain (``power_of_2_scales`` is not applied to stored weights); delayed
    weight scaling is per-tensor only. The fused step ([Note: fused step]) is per-tensor only:
    with a tiled weight ``step_kernel='auto'`` takes the reference kernel.
"""

from __future__ import annotations

from typing import Literal

import torch

from fp8shard.fp8 import (
    AmaxHistory,
    DelayedScaling,
    Float8Tensor,
    Fp8Format,
    cast_to_fp8,
    scale_from_amax,
)
from fp8shard.fp8.quantizer import tile_scales, weight_quantizer
from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.layout import ShardPiece

ScalingMode = Literal["current", "delayed"]


class Fp8WeightScaler:
    """Scales of the FP8 parameters: one slot per per-tensor parameter (ordered by parameter
    index), then one per tile of each rowwise or blockwise one ([Note: tiled weight casts])."""

    def __init__(self, params: dict[int, Float8Tensor], mode: ScalingMode,
                 recipe: DelayedScaling | None, device: torch.device) -> None:
        if mode not in ("current", "delayed"):
            raise ValueError(f"fp8_weight_scaling must be 'current' or 'delayed', got {mode!r}")
        self.mode = mode
        order = sorted(i for i in params if params[i].block is None)
        self.tiled = {i: params[i] for i in sorted(params) if params[i].block is not None}
        if self.tiled and mode == "delayed":
            raise ValueError("fp8_weight_scaling='delayed' is per-tensor only: rowwise or blockwise FP8 "
                             "weights are cast with current scaling; pass fp8_weight_scaling='current'")
        self.slot = {i: s for s, i in enumerate(order)}
        n = len(order)
        # Each tiled weight's slots [start, start + tiles) and the quantizer of its tiles.
        self.span: dict[int, tuple[int, int]] = {}
        for i, p in self.tiled.items():
            self.slot[i] = n + sum(k for _, k in self.span.values())
            self.span[i] = (self.slot[i], p._scale_inv.numel())
        self.quantizer = {i: weight_quantizer(p.block) for i, p in self.tiled.items()}  # type: ignore[arg-type]
        self.fmt_max = torch.tensor([params[i].fp8_format.max for i in order], dtype=torch.float32,
                                    device=device)
        # Slots by format, so current scaling divides by a Python float exactly as
        # Float8Tensor.quantize does (``float / tensor`` rounds differently from tensor / tensor).
        self._by_format = [
            (fmt.max, torch.tensor([s for s, i in enumerate(order) if params[i].fp8_format is fmt],
                                   dtype=torch.long, device=device))
            for fmt in Fp8Format if any(params[i].fp8_format is fmt for i in order)
        ]
        # Start from each weight's own scale (its init amax), not 1 (ANCHORS.md: TE 1121).
        init = [params[i]._scale_inv.float().reciprocal().reshape(-1).to(device) for i in self.slot]
        self.scale = torch.cat(init) if init else torch.zeros(0, device=device)
        self._slot_cache: dict[int, torch.Tensor] = {}
        self._ready: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}
        self._amax = self.scale.new_zeros(0)  # the last reduced amax (the tiled casts' stats)
        self.history: AmaxHistory | None = None
        if mode == "delayed":
            self.history = AmaxHistory(n, recipe or DelayedScaling(), self.fmt_max, device=device)
            self.history.scale = self.scale.clone()

    @property
    def num_slots(self) -> int:
        return int(self.scale.numel())

    def local_amax(self, regions: list[RegionBuffers]) -> torch.Tensor:
        """Per-slot max |master| over this rank's pieces (0 where it owns none)."""
        out = torch.zeros(self.num_slots, dtype=torch.float32, device=self.scale.device)
        for rb in regions:
            if not rb.is_fp8 or not rb.pieces:
                continue
            if rb.layout.unit > 1:  # whole rows or bands: [Note: tiled weight casts]
                for pc in rb.pieces:
                    x, at, _ = self._tile_piece(rb, pc)
                    stats = self.quantizer[pc.param_index].local_stats(x, "weight").reshape(-1)
                    out[at:at + stats.numel()] = stats
                continue
            views = [rb.master[pc.local_offset:pc.local_offset + pc.numel] for pc in rb.pieces]
            # The inf-norm is max |x|: one multi-tensor kernel over all pieces, then one scatter.
            amaxes = torch.stack(torch._foreach_norm(views, float("inf")))
            out.scatter_reduce_(0, self._slots(rb), amaxes.float(), reduce="amax")
        return out

    def _tile_piece(self, rb: RegionBuffers, pc: ShardPiece) -> tuple[torch.Tensor, int, tuple[int, int]]:
        """A tiled weight's piece of the master as 2-D [rows, cols], its first tile's slot and
        the shape of its part of the scale grid."""
        p = self.tiled[pc.param_index]
        cols, br = p.shape[1], p.block[0]  # type: ignore[index]
        x = rb.master[pc.local_offset:pc.local_offset + pc.numel].view(-1, cols)
        grid = (-(-x.shape[0] // br), p._scale_inv.shape[1])
        return x, self.span[pc.param_index][0] + pc.param_offset // cols // br * grid[1], grid

    def _slots(self, rb: RegionBuffers) -> torch.Tensor:
        """Slot of each of ``rb.pieces``, as a device tensor (built once)."""
        key = id(rb)
        if key not in self._slot_cache:
            self._slot_cache[key] = torch.tensor([self.slot[pc.param_index] for pc in rb.pieces],
                                                 dtype=torch.long, device=rb.master.device)
        return self._slot_cache[key]

    def known_scales(self) -> torch.Tensor | None:
        """The scales this step's cast will use, when they are known before this step's amax
        (delayed scaling: the history's scale from before step t), else None (current scaling
        needs the global amax of the new master first). The fused step casts in its Adam pass
        when they are known ([Note: fused step])."""
        return None if self.history is None else self.history.scale

    def cast_scales(self, global_amax: torch.Tensor) -> torch.Tensor:
        """The scales to cast this step's master with (and advance the scaling state)."""
        if self.history is None:
            new = self.scale.clone()
            for fmt_max, idx in self._by_format:
                new[idx] = scale_from_amax(global_amax[idx], fmt_max, self.scale[idx])
            for i, (start, k) in self.span.items():  # the tiles' scales, as their quantizer's cast
                new[start:start + k] = tile_scales(global_amax[start:start + k], self.tiled[i].fp8_format)
            self.scale, self._amax = new, global_amax
            return new
        used = self.history.scale.clone()
        hist0 = self.history.history[0]
        torch.maximum(hist0, global_amax, out=hist0)
        self.history.update()
        return used

    def cast_region(self, rb: RegionBuffers, scales: torch.Tensor) -> None:
        """Quantize this rank's master shard of an FP8 region into its shards of the bytes."""
        if rb.layout.unit > 1:  # tile by tile through each weight's quantizer
            for pc in rb.pieces:
                x, at, grid = self._tile_piece(rb, pc)
                stats = self._amax[at:at + grid[0] * grid[1]].view(grid)
                fmt = self.tiled[pc.param_index].fp8_format
                op = self.quantizer[pc.param_index].cast(x, stats, fmt, "weight")
                rb.param_buffer[pc.region_offset:pc.region_offset + pc.numel].copy_(
                    op.data.reshape(-1).view(torch.uint8))
            return
        # A per-element scale (gaps and padding get 0; their master is 0 anyway), so each bucket
        # shard is one cast_to_fp8 call, elementwise identical to quantizing each parameter.
        per_elem = torch.zeros(rb.layout.shard_numel, dtype=torch.float32, device=rb.master.device)
        piece_scales = scales[self._slots(rb)]
        for k, pc in enumerate(rb.pieces):
            per_elem[pc.local_offset:pc.local_offset + pc.numel] = piece_scales[k]
        fmt = rb.fmt
        for b in rb.layout.buckets:  # straight into this rank's shard of the bucket's bytes
            cast_to_fp8(rb.local(rb.master, b.index), rb.local(per_elem, b.index), fmt,
                        out=rb.shard(rb.param_buffer, b.index))

    def set_scale_inv(self, params: dict[int, Float8Tensor], scale_inv: torch.Tensor) -> None:
        """Give ``params`` (their bytes just gathered) their slots of ``scale_inv`` (the inverse
        of ``cast_scales``'s result) in one batched copy, and drop their cached transposes."""
        key = tuple(params)
        hit = self._ready.get(key)
        if hit is None:
            spans = [self.span.get(i, (self.slot[i], 1)) for i in key]
            idx = torch.cat([torch.arange(s, s + k) for s, k in spans]).to(scale_inv.device)
            hit = self._ready[key] = (idx, [k for _, k in spans])
        new = scale_inv.index_select(0, hit[0]).split(hit[1])
        dst = [p._scale_inv for p in params.values()]
        torch._foreach_copy_(dst, [v.view(d.shape) for v, d in zip(new, dst, strict=True)])
        for p in params.values():
            p.mark_bytes_changed()  # drops the cached transpose (TE 1596)

    # ------------------------------------------------------------------ checkpoint
    def state(self, index: int) -> dict[str, torch.Tensor]:
        if index in self.span:  # a tiled weight: its scale grid
            start, k = self.span[index]
            return {"scale": self.scale[start:start + k].view(self.tiled[index]._scale_inv.shape).clone()}
        s = self.slot[index]
        out = {"scale": self.scale[s].clone() if self.history is None else self.history.scale[s].clone()}
        if self.history is not None:
            out["amax_history"] = self.history.history[:, s].clone()
        return out

    def load_state(self, index: int, sd: dict[str, torch.Tensor]) -> None:
        if index in self.span:
            start, k = self.span[index]
            if sd["scale"].numel() != k:
                raise ValueError(f"parameter {index}: the checkpoint has {sd['scale'].numel()} weight "
                                 f"scales, this {self.quantizer[index].name} weight has {k} tiles")
            self.scale[start:start + k] = sd["scale"].reshape(-1).to(self.scale)
            return
        s = self.slot[index]
        if self.history is None:
            self.scale[s] = sd["scale"].to(self.scale)
            return
        if "amax_history" not in sd:
            raise ValueError(f"parameter {index}: checkpoint has no amax_history, but "
                             "fp8_weight_scaling='delayed' needs one; load with 'current' scaling")
        hist = sd["amax_history"].to(self.history.history)
        if hist.shape[0] != self.history.history.shape[0]:
            raise ValueError(f"parameter {index}: amax history of length {hist.shape[0]} does not "
                             f"match amax_history_len={self.history.history.shape[0]}")
        self.history.history[:, s] = hist
        self.history.scale[s] = sd["scale"].to(self.scale)


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
Each of them goes through the weight's ``Quantizer`` ([Note: quantizer]), chosen once here, for
every recipe alike: ``local_stats`` of each piece of the master shard, the packed reduction (the
caller's all-reduce MAX), ``scales`` (the quantizer's rule: per-tensor ``TensorwiseQuantizer``
with the previous-scale guard, ``DelayedTensorwiseQuantizer`` with its amax history, the tiled
quantizers per tile), ``cast_scaled`` into the shard's bytes. Per-tensor scaling is one
implementation of the protocol, not a branch of this class.

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
    Scales are current (the tile's amax of the new master; a zero or non-finite amax gives
    scale 1) and plain (``power_of_2_scales`` is not applied to stored weights); delayed
    weight scaling is per-tensor only. The fused step ([Note: fused step]) is per-tensor only:
    with a tiled weight ``step_kernel='auto'`` takes the reference kernel.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from fp8shard.fp8 import DelayedScaling, Float8Tensor, Fp8Format
from fp8shard.fp8.quantizer import (
    DelayedTensorwiseQuantizer,
    Quantizer,
    TensorwiseQuantizer,
    weight_quantizer,
)
from fp8shard.optim.buffers import RegionBuffers

ScalingMode = Literal["current", "delayed"]


class _Group(NamedTuple):
    """FP8 weights whose scales one quantizer computes in one call."""

    quantizer: Quantizer
    fmt: Fp8Format
    slots: torch.Tensor
    """int64: the group's slots, in order (the quantizer's columns)."""


class _Piece(NamedTuple):
    """One piece of this rank's master shard of a weight, as its quantizer sees it."""

    quantizer: Quantizer
    fmt: Fp8Format
    local: slice
    """Its elements in the region's master (this rank's shard)."""
    out: slice
    """Its elements in the region's parameter buffer (the bytes)."""
    cols: int
    """Row length of its 2-D view (whole rows of a tiled weight; the piece itself, per tensor)."""
    slots: slice
    """The slots of its tiles (contiguous)."""
    grid: tuple[int, int]
    """Its part of the weight's scale grid."""


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
        recipe = recipe or DelayedScaling()
        self.amax_history_len = recipe.amax_history_len if mode == "delayed" else None
        # Each weight's slots [start, start + tiles): per-tensor ones first, by index.
        self.slot: dict[int, int] = {}
        self.span: dict[int, tuple[int, int]] = {}
        n = 0
        for i in [*order, *self.tiled]:
            self.slot[i], self.span[i] = n, (n, params[i]._scale_inv.numel())
            n += self.span[i][1]
        # Per-tensor weights of one format share a quantizer (one ``scales`` call for them all);
        # a tiled weight has its own.
        members: dict[tuple[object, ...], list[int]] = {}
        for i in self.span:
            p = params[i]
            members.setdefault(("tensor", p.fp8_format) if p.block is None else ("tiles", i), []).append(i)
        self.groups: list[_Group] = []
        self._col: dict[int, tuple[Quantizer, int]] = {}  # weight -> (its quantizer, its column)
        for idx in members.values():
            p = params[idx[0]]
            q = _choose_quantizer(p, mode, recipe, len(idx), device)
            slots = [s for i in idx for s in range(self.span[i][0], sum(self.span[i]))]
            self.groups.append(_Group(q, p.fp8_format, torch.tensor(slots, dtype=torch.long, device=device)))
            for col, i in enumerate(idx):
                self._col[i] = (q, col)
        # Each weight as its quantizer's stats and casts see it: 2-D [rows, cols], one scale per
        # (block rows) x (grid cols) tile; a per-tensor weight is one row of numel elements, one
        # tile; and the shape of its scales in a checkpoint (0-d per tensor, else the grid).
        self._geometry = {i: _geometry(p) for i, p in params.items()}
        self._fmt = {i: p.fp8_format for i, p in params.items()}
        self._ahead = any(g.quantizer.ahead for g in self.groups)  # delayed: scales known first
        # Start from each weight's own scale (its init amax), not 1 (ANCHORS.md: TE 1121).
        init = [params[i]._scale_inv.float().reciprocal().reshape(-1).to(device) for i in self.slot]
        self.scale = torch.cat(init) if init else torch.zeros(0, device=device)
        self._plans: dict[int, tuple[list[_Piece], torch.Tensor]] = {}
        self._ready: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}

    @property
    def num_slots(self) -> int:
        return int(self.scale.numel())

    def quantizer(self, index: int) -> Quantizer:
        """The quantizer of FP8 parameter ``index``."""
        return self._col[index][0]

    def _plan(self, rb: RegionBuffers) -> tuple[list[_Piece], torch.Tensor]:
        """``rb``'s pieces as their quantizers see them, and the slot of each of their stats
        (built once)."""
        key = id(rb)
        if key not in self._plans:
            pieces = []
            for pc in rb.pieces:
                i = pc.param_index
                q, _ = self._col[i]
                cols, br, gc, _ = self._geometry[i]
                width = max(min(cols, pc.numel), 1)  # tiled: whole rows ([Note: tiled weight casts])
                first = self.span[i][0] + pc.param_offset // (cols * br) * gc
                grid = (-(-(pc.numel // width) // br), gc)
                pieces.append(_Piece(q, self._fmt[i], slice(pc.local_offset, pc.local_offset + pc.numel),
                                     slice(pc.region_offset, pc.region_offset + pc.numel), width,
                                     slice(first, first + grid[0] * grid[1]), grid))
            idx = [s for p in pieces for s in range(p.slots.start, p.slots.stop)]
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

    def known_scales(self) -> torch.Tensor | None:
        """The scales this step's cast will use, when they are known before this step's amax
        (delayed scaling: the scales its quantizer computed from the history before step t), else
        None (current scaling needs the global amax of the new master first). The fused step
        casts in its Adam pass when they are known ([Note: fused step])."""
        return self.scale if self._ahead else None

    def cast_scales(self, global_amax: torch.Tensor) -> torch.Tensor:
        """The scales to cast this step's master with (and advance the scaling state): every
        group's quantizer's ``scales`` from the reduced stats, the scales in use as ``prev``.
        Delayed: the cast uses the scales from before; the new ones serve the next step."""
        new = self.scale.clone()
        for g in self.groups:
            new[g.slots] = g.quantizer.scales(global_amax[g.slots], g.fmt, self.scale[g.slots])
        used = self.scale if self._ahead else new
        self.scale = new
        return used

    def cast_region(self, rb: RegionBuffers, scales: torch.Tensor) -> None:
        """Quantize this rank's master shard of an FP8 region into its shards of the bytes: each
        piece through its quantizer's ``cast_scaled``, with its tiles' scales."""
        pieces, _ = self._plan(rb)
        for p in pieces:
            p.quantizer.cast_scaled(rb.master[p.local].view(-1, p.cols), scales[p.slots].view(p.grid), p.fmt,
                                    "weight", out=rb.param_buffer[p.out].view(-1, p.cols))

    def set_scale_inv(self, params: dict[int, Float8Tensor], scale_inv: torch.Tensor) -> None:
        """Give ``params`` (their bytes just gathered) their slots of ``scale_inv`` (the inverse
        of ``cast_scales``'s result) in one batched copy, and drop their cached transposes."""
        key = tuple(params)
        hit = self._ready.get(key)
        if hit is None:
            spans = [self.span[i] for i in key]
            idx = torch.cat([torch.arange(s, s + k) for s, k in spans]).to(scale_inv.device)
            hit = self._ready[key] = (idx, [k for _, k in spans])
        new = scale_inv.index_select(0, hit[0]).split(hit[1])
        dst = [p._scale_inv for p in params.values()]
        torch._foreach_copy_(dst, [v.view(d.shape) for v, d in zip(new, dst, strict=True)])
        for p in params.values():
            p.mark_bytes_changed()  # drops the cached transpose (TE 1596)

    # ------------------------------------------------------------------ checkpoint
    def state(self, index: int) -> dict[str, torch.Tensor]:
        """Parameter ``index``'s scales (its scale grid for a tiled weight; the next cast's for
        delayed scaling) and what its quantizer keeps beside them (delayed: the amax history)."""
        start, k = self.span[index]
        q, col = self._col[index]
        scale = self.scale[start:start + k].view(self._geometry[index][3]).clone()
        return {"scale": scale, **q.state(col)}

    def load_state(self, index: int, sd: dict[str, torch.Tensor]) -> None:
        start, k = self.span[index]
        q, col = self._col[index]
        if sd["scale"].numel() != k:
            raise ValueError(f"parameter {index}: the checkpoint has {sd['scale'].numel()} weight "
                             f"scales, this {q.name} weight has {k} tiles")
        q.load_state(col, sd, f"parameter {index}")
        self.scale[start:start + k] = sd["scale"].reshape(-1).to(self.scale)


def _choose_quantizer(p: Float8Tensor, mode: ScalingMode, recipe: DelayedScaling, n: int,
                      device: torch.device) -> Quantizer:
    """The one choice: the quantizer of ``n`` FP8 weights like ``p`` (its recipe's, by its scale
    grid; per tensor: current, or delayed with an amax history of ``n`` columns)."""
    if p.block is not None:
        return weight_quantizer(p.block)
    if mode == "delayed":
        return DelayedTensorwiseQuantizer(n, recipe, p.fp8_format, device=device)
    return TensorwiseQuantizer()


def _geometry(p: Float8Tensor) -> tuple[int, int, int, tuple[int, ...]]:
    """(cols, block rows, grid cols, scale shape) of ``p`` as its quantizer sees it."""
    if p.block is None:
        return max(p.numel(), 1), 1, 1, ()
    return p.shape[1], p.block[0], p._scale_inv.shape[1], tuple(p._scale_inv.shape)

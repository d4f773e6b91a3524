"""FP32 master shard -> FP8 bytes of the same shard, with one scale per parameter.

[Note: weight scaling] (docs/design.md): every rank computes the amax of its slices of each FP8
parameter, ONE packed all-reduce(MAX) gives the global amaxes, and every rank derives the same
scales from them, so the shards it casts form one consistent tensor after the all-gather.

* ``current`` (default): the cast at step t uses ``scale = fmt.max / global_amax(master_t)``
  (guards of ``scale_from_amax``: zero or non-finite amax keeps the previous scale).
* ``delayed`` (Transformer Engine's recipe, for parity with the anchors): the cast at step t uses
  the scale computed from the amax history *before* step t; the global amax of master_t is then
  recorded and the scale for step t+1 computed from the window.

The optimizer talks to FP8 through this class only: slots, amaxes, scales, and a cast into bytes.
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
from fp8shard.optim.buffers import RegionBuffers

ScalingMode = Literal["current", "delayed"]


class Fp8WeightScaler:
    """Scales of the FP8 parameters, one slot per parameter (ordered by parameter index)."""

    def __init__(self, params: dict[int, Float8Tensor], mode: ScalingMode,
                 recipe: DelayedScaling | None, device: torch.device) -> None:
        if mode not in ("current", "delayed"):
            raise ValueError(f"fp8_weight_scaling must be 'current' or 'delayed', got {mode!r}")
        self.mode = mode
        self.slot = {i: s for s, i in enumerate(sorted(params))}
        order = sorted(params)
        n = len(order)
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
        init_scale = torch.stack([params[i]._scale_inv.float().reciprocal() for i in order]) \
            if n else torch.zeros(0, device=device)
        self.scale = init_scale.to(device)
        self._slot_cache: dict[int, torch.Tensor] = {}
        self.history: AmaxHistory | None = None
        if mode == "delayed":
            self.history = AmaxHistory(n, recipe or DelayedScaling(), self.fmt_max, device=device)
            self.history.scale = self.scale.clone()

    @property
    def num_slots(self) -> int:
        return len(self.slot)

    def local_amax(self, regions: list[RegionBuffers]) -> torch.Tensor:
        """Per-slot max |master| over this rank's pieces (0 where it owns none)."""
        out = torch.zeros(self.num_slots, dtype=torch.float32, device=self.scale.device)
        for rb in regions:
            if not rb.is_fp8 or not rb.pieces:
                continue
            views = [rb.master[pc.local_offset:pc.local_offset + pc.numel] for pc in rb.pieces]
            # The inf-norm is max |x|: one multi-tensor kernel over all pieces, then one scatter.
            amaxes = torch.stack(torch._foreach_norm(views, float("inf")))
            out.scatter_reduce_(0, self._slots(rb), amaxes.float(), reduce="amax")
        return out

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
            self.scale = new
            return new
        used = self.history.scale.clone()
        hist0 = self.history.history[0]
        torch.maximum(hist0, global_amax, out=hist0)
        self.history.update()
        return used

    def cast_region(self, rb: RegionBuffers, scales: torch.Tensor) -> None:
        """Quantize this rank's master shard of an FP8 region into its shards of the bytes."""
        # A per-element scale (gaps and padding get 0; their master is 0 anyway), so each bucket
        # shard is one cast_to_fp8 call, elementwise identical to quantizing each parameter.
        per_elem = torch.zeros(rb.layout.shard_numel, dtype=torch.float32, device=rb.master.device)
        piece_scales = scales[self._slots(rb)]
        for k, pc in enumerate(rb.pieces):
            per_elem[pc.local_offset:pc.local_offset + pc.numel] = piece_scales[k]
        fmt = Fp8Format.parse(rb.dtype)
        for b in rb.layout.buckets:  # straight into this rank's shard of the bucket's bytes
            cast_to_fp8(rb.local(rb.master, b.index), rb.local(per_elem, b.index), fmt,
                        out=rb.shard(rb.param_buffer, b.index))

    # ------------------------------------------------------------------ checkpoint
    def state(self, index: int) -> dict[str, torch.Tensor]:
        s = self.slot[index]
        out = {"scale": self.scale[s].clone() if self.history is None else self.history.scale[s].clone()}
        if self.history is not None:
            out["amax_history"] = self.history.history[:, s].clone()
        return out

    def load_state(self, index: int, sd: dict[str, torch.Tensor]) -> None:
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


"""Optimizer state in model space: per parameter, full global shapes. See [Note: checkpoint space].

``full_states`` gathers each shard-size buffer (master, exp_avg, exp_avg_sq) bucket by bucket
and cuts the result into per-parameter tensors, on every rank. That costs one full copy of the
states in host/device memory during a save (acceptable for now; the sharded DCP checkpoint of a
later issue builds on ``sharded_states``, which moves nothing). ``load_full_states`` and
``load_sharded_states`` are the inverses and need no communication: every rank copies the
pieces it owns.
"""

from __future__ import annotations

import torch

from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.collectives import Group

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


def _gather_region(rb: RegionBuffers, shard: torch.Tensor, group: Group) -> torch.Tensor:
    full = torch.empty(rb.layout.numel, dtype=shard.dtype, device=shard.device)
    for b in rb.layout.buckets:
        group.all_gather(rb.bucket(full, b.index), rb.local(shard, b.index),
                         kind="all_gather.checkpoint")
    return full


def full_states(regions: list[RegionBuffers], shapes: dict[int, torch.Size],
                group: Group) -> dict[int, dict[str, torch.Tensor]]:
    """``{param index: {'master', 'exp_avg', 'exp_avg_sq'}}``, full shapes, on every rank."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for rb in regions:
        fulls = {name: _gather_region(rb, getattr(rb, name), group) for name in STATE_NAMES}
        for pr in rb.layout.params:
            out[pr.index] = {
                name: full[pr.start:pr.end].view(shapes[pr.index]).clone() for name, full in fulls.items()
            }
    return dict(sorted(out.items()))


def load_full_states(regions: list[RegionBuffers], shapes: dict[int, torch.Size],
                     state: dict[int, dict[str, torch.Tensor]]) -> None:
    """Copy this rank's pieces out of full per-parameter tensors."""
    for i, shape in shapes.items():
        if i not in state:
            raise KeyError(f"the checkpoint has no state for parameter {i}; was it saved from a "
                           "model with the same parameters in the same order?")
        for name in STATE_NAMES:
            t = state[i].get(name)
            if t is None:
                raise KeyError(f"parameter {i}: the checkpoint has no '{name}'")
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"parameter {i}: checkpoint '{name}' has shape {tuple(t.shape)}, the "
                                 f"model has {tuple(shape)}; was the model changed?")
    for rb in regions:
        for pc in rb.pieces:
            for name in STATE_NAMES:
                src = state[pc.param_index][name].reshape(-1)
                dst = getattr(rb, name)
                dst[pc.local_offset:pc.local_offset + pc.numel].copy_(
                    src[pc.param_offset:pc.param_offset + pc.numel])


def sharded_states(regions: list[RegionBuffers]) -> dict[int, list[dict[str, object]]]:
    """This rank's pieces: ``{param index: [{'offset', 'numel', 'master', ...}]}`` (views, no copy).

    ``offset`` is the piece's position in the flattened global parameter, so pieces written by N
    ranks can be reassembled (or re-split for M ranks) without the bucket layout.
    """
    out: dict[int, list[dict[str, object]]] = {}
    for rb in regions:
        for pc in rb.pieces:
            sl = slice(pc.local_offset, pc.local_offset + pc.numel)
            entry: dict[str, object] = {"offset": pc.param_offset, "numel": pc.numel}
            entry.update({name: getattr(rb, name)[sl] for name in STATE_NAMES})
            out.setdefault(pc.param_index, []).append(entry)
    return dict(sorted(out.items()))


def load_sharded_states(regions: list[RegionBuffers], state: dict[int, list[dict[str, object]]]) -> None:
    """Fill this rank's pieces from pieces of any split (e.g. written at another world size).

    Each saved entry is ``{'offset', 'numel', 'master', 'exp_avg', 'exp_avg_sq'}`` in the
    flattened global parameter; every element this rank owns must be covered.
    """
    for rb in regions:
        for pc in rb.pieces:
            lo, hi = pc.param_offset, pc.param_offset + pc.numel
            covered = 0
            for e in state.get(pc.param_index, []):
                o, n = int(e["offset"]), int(e["numel"])  # type: ignore[call-overload]
                s, t = max(lo, o), min(hi, o + n)
                if t <= s:
                    continue
                for name in STATE_NAMES:
                    src: torch.Tensor = e[name]  # type: ignore[assignment]
                    dst = getattr(rb, name)
                    dst[pc.local_offset + s - lo:pc.local_offset + t - lo].copy_(src.reshape(-1)[s - o:t - o])
                covered += t - s
            if covered != pc.numel:
                raise ValueError(f"parameter {pc.param_index}: the sharded state covers {covered} of the "
                                 f"{pc.numel} elements [{lo}, {hi}) this rank owns; are pieces missing?")

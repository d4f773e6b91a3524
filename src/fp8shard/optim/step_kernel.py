"""The step kernel: the arithmetic of one optimizer step on this rank's shards, chosen once.

[Note: step kernel]
    Every step's arithmetic goes through one ``StepKernel`` of the optimizer's engine
    ([Note: engine]), picked when the engine is built (the flat engine: ``fused=``, whether
    Triton serves the device, or ``step_kernel=``):

      ``FlatReferenceKernel`` (here)   PyTorch ops on the flat engine's regions: an fp32 copy of
                                       the gradient shard, ``adam_`` over runs of the master,
                                       ``Fp8WeightScaler``'s amax and cast (its base,
                                       ``ReferenceKernel``, is in fused_step.py beside ``adam_``)
      ``FusedKernel`` (fused_step.py)  the two tile kernels of [Note: fused step] (Triton where it
                                       serves, else their PyTorch reference ops): the gradient is
                                       read in place from the bucket buffer, in bf16
      ``FSDP2Kernel`` (fsdp2.py)       ``ReferenceKernel`` on FSDP2's local shards
      ``FSDP2FusedKernel`` (fsdp2.py)  the fused step's tile kernels on each FSDP2 local shard
                                       (``step_kernel='auto'`` takes it where the flat engine takes
                                       ``FusedKernel``: Triton serves, per-tensor FP8 weights)

    The flat kernels give the same skip decision and, with the reference ops, the same bytes
    (tested bit for bit). A kernel provides:

      grad_shards()           this rank's reduce-scattered gradient, as ``update`` reads it
      grad_sumsq(shards)      the sum of squares of those shards (0-d fp32; inf/NaN if any is)
      clip_(grads, coef)      apply a clipping coefficient (now, or as ``update`` reads the gradient)
      update(grads, hps)      Adam(W) on the master shards and states
      local_amax()            per FP8 slot, max |new master| over this rank's pieces
      cast(scales, grads)     this rank's shards of the parameters from the new master
      decides_on_device       True: ``update`` and ``cast`` leave everything as it was where
                              ``grads.apply`` is False, read on the device, so ``step()`` never
                              waits for the skip decision ([Note: skip on the device], core.py);
                              False: the optimizer reads it on the host first and calls neither

    The optimizer owns the order (``ShardedAdam.step()``: finish the gradient reduction; update,
    amax all-reduce, cast; launch the gathers) and every collective; a kernel never communicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.fp8_weights import Fp8WeightScaler
from fp8shard.optim.fused_step import AdamScalars, ReferenceKernel, Run


@dataclasses.dataclass
class StepGrads:
    """This step's gradient on this rank, reduced over the group, and its global statistics.

    Made once per accumulation window (by the optimizer's first ``step()`` or ``clip_grad_norm``
    after a backward) and dropped by ``step()`` and ``zero_grad()``.
    """

    shards: list[torch.Tensor]
    """What the kernel's ``update`` reads: fp32 copies of the shards (``ReferenceKernel``) or
    views of this rank's shards in the bucket buffers, in ``grad_sync_dtype`` (``FusedKernel``)."""
    sumsq: torch.Tensor
    """0-d fp32: the global sum of squares of the averaged gradient (before any clipping)."""
    apply: torch.Tensor
    """0-d bool on the gradient's device: the sum of squares is finite (no inf or NaN on any
    rank, no square that overflows fp32) and some rank accumulated a gradient ([Note: step
    without gradients]). A kernel that ``decides_on_device`` reads it there ([Note: skip on the
    device])."""
    stats: torch.Tensor
    """The reduced (sum of squares, ranks with a gradient) on the host: a CPU tensor, or a pinned
    copy still in flight until ``ready`` has passed (the optimizer reads it: ``host_skip``)."""
    ready: torch.cuda.Event | None = None
    """Recorded after the copy into ``stats`` (CUDA), else None."""
    coef: torch.Tensor | None = None
    """0-d fp32 clipping coefficient the kernel multiplies the gradient by as it reads it, or None
    (``FusedKernel``; ``ReferenceKernel`` scales its fp32 copies in place instead)."""


class StepKernel(Protocol):
    """The arithmetic of a step on this rank's shards; see [Note: step kernel]."""

    def grad_shards(self) -> list[torch.Tensor]: ...

    def grad_sumsq(self, shards: list[torch.Tensor]) -> torch.Tensor: ...

    def clip_(self, grads: StepGrads, coef: torch.Tensor) -> None: ...

    def update(self, grads: StepGrads, hps: Sequence[AdamScalars]) -> None: ...

    def local_amax(self) -> torch.Tensor: ...

    def cast(self, scales: torch.Tensor | None, grads: StepGrads) -> None: ...

    decides_on_device: bool


def adam_runs(regions: Sequence[RegionBuffers], group_of: Mapping[int, int],
              num_groups: int) -> list[list[Run]]:
    """Per param group: the (region index, lo, hi) ranges of the local shards that Adam updates.

    Neighbouring pieces of one group merge into one range; what lies between them in the local
    shard is padding (zero gradient, zero master), which Adam leaves at zero.
    """
    runs: list[list[Run]] = [[] for _ in range(num_groups)]
    for ri, rb in enumerate(regions):
        cur: list[int] | None = None  # [group, lo, hi]
        for pc in sorted(rb.pieces, key=lambda pc: pc.local_offset):
            g = group_of[pc.param_index]
            if cur is not None and cur[0] == g:
                cur[2] = pc.local_offset + pc.numel
                continue
            if cur is not None:
                runs[cur[0]].append((ri, cur[1], cur[2]))
            cur = [g, pc.local_offset, pc.local_offset + pc.numel]
        if cur is not None:
            runs[cur[0]].append((ri, cur[1], cur[2]))
    return runs


class FlatReferenceKernel(ReferenceKernel):
    """The reference kernel on the flat engine's regions: the gradient shards copied out of the
    bucket buffers, ``Fp8WeightScaler``'s amax and cast for FP8 regions, ``master.to(dtype)``
    for the others."""

    def __init__(self, regions: Sequence[RegionBuffers], group_of: Mapping[int, int], num_groups: int,
                 scaler: Fp8WeightScaler) -> None:
        super().__init__([rb.master for rb in regions], [rb.exp_avg for rb in regions],
                         [rb.exp_avg_sq for rb in regions], adam_runs(regions, group_of, num_groups),
                         scaler, regions[0].master.device)
        self.regions = list(regions)

    def grad_shards(self) -> list[torch.Tensor]:
        return [rb.grad_shard_fp32() for rb in self.regions]

    def local_amax(self) -> torch.Tensor:
        return self.fp8.local_amax(self.regions)

    def cast(self, scales: torch.Tensor | None, grads: StepGrads) -> None:
        for rb in self.regions:
            if rb.is_fp8:
                assert scales is not None
                self.fp8.cast_region(rb, scales)
            else:
                rb.write_param_shards(rb.master.to(rb.dtype))

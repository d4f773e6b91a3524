"""The step's ops: the reference Adam(W) update, and the fused step that reproduces it.

First the reference: ``adam_`` (the update on flat fp32 shards, a pure function) and
``ReferenceKernel`` (a step kernel of PyTorch ops over runs of flat state tensors, which each
engine completes for its storage: ``FlatReferenceKernel`` in step_kernel.py, ``FSDP2Kernel`` in
fsdp2.py). Then the fused step: tile tables, the dispatch to the Triton kernels, their reference
ops and ``FusedKernel``. They live in one module so that a step, on either path, runs its
arithmetic here ([Note: step kernel]).

[Note: fused step]
    On CUDA with Triton (``fp8shard._triton.use_triton``) the optimizer step on a region is two
    passes over the local shard instead of about ten:

      kernel 1 (``adam_tiles_``)  reads master, exp_avg, exp_avg_sq (fp32 or 16-bit) and this
                  rank's gradient shard straight from the bucket buffer (bf16 or fp32: no fp32 copy);
                  writes master, exp_avg, exp_avg_sq; FP8 regions: the tile's amax of the NEW master
                  into ``partial_amax[tile]``, and with delayed scaling (the scale of step t is
                  known before step t) also the FP8 bytes (27 B/param with a bf16 gradient);
                  other regions: the parameter shard in its dtype (``master.to(dtype)``).
      kernel 2 (``cast_tiles_``)  current scaling: after the one amax all-reduce, reads master and
                  writes the FP8 bytes with each parameter's scale (5 B/param).

    Both walk a *tile table* (``TileTable``), built once per region: this rank's pieces
    ([Note: shard layout]) cut into tiles of at most ``block`` elements that never cross a piece,
    so each tile belongs to one parameter (one FP8 scale slot, one param group). One Triton program
    handles one tile: it knows its slot's scale and writes its own partial amax (no atomics); a
    ``scatter_reduce(amax)`` over tiles gives the per-slot amaxes. Padding is never touched.

    The arithmetic is ``adam_``'s reference formulas (above) op by op in fp32 (IEEE sqrt and
    division, the fused multiply-adds where PyTorch's CUDA foreach kernels use them), the cast is
    ``cast_to_fp8`` (x * scale in fp32, clamp to +-max keeping NaN, round to nearest even, as
    c10's conversion), and the amax is exact. Every op here has a PyTorch reference
    implementation (``_*_reference``), used where Triton is not (CPU;
    ``fp8shard.set_triton(False)``), which reproduces what ``adam_``,
    ``Fp8WeightScaler.local_amax`` and ``cast_region`` compute; the reference cast is the
    per-tensor quantizer's own (``TensorwiseQuantizer.cast_scaled``, [Note: quantizer]).

    ``FusedKernel`` (at the end) is the optimizer's step kernel made of these ops
    ([Note: step kernel] in step_kernel.py): it builds the tile tables once and asks
    ``use_triton`` once, when the optimizer is built.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from fp8shard._triton import use_triton
from fp8shard.fp8 import Fp8Format
from fp8shard.fp8.quantizer import TensorwiseQuantizer, WeightQuantizers
from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.layout import ShardPiece

if TYPE_CHECKING:
    from fp8shard.optim.step_kernel import StepGrads

Run = tuple[int, int, int]
"""(unit, lo, hi): a range of one flat state tensor (master, states) of one param group."""

DEFAULT_BLOCK = 2048
"""Elements per tile (one Triton program). A power of two."""

# What kernel 1 writes besides master and states (``out_mode``).
OUT_NONE = 0  # nothing
OUT_AMAX = 1  # FP8 region, current scaling: the tile amax (the cast waits for the global amax)
OUT_AMAX_CAST = 2  # FP8 region, delayed scaling: the tile amax and the FP8 bytes
OUT_PARAM = 3  # other regions: the parameter shard in the buffer's dtype


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (nearest even), as PyTorch rounds a Python scalar for an fp32 op."""
    return struct.unpack("f", struct.pack("f", x))[0]


# ============================================================================ the reference update
# The Adam(W) formulas of ``torch.optim.Adam`` (single-tensor path), op by op, on flat fp32 shards,
# so on the same inputs the master comes out bit-identical to it (tests/optim/test_adam.py):
#
#     AdamW: p *= 1 - lr * wd                 Adam + L2: g = g + wd * p
#     m.lerp_(g, 1 - beta1);  v = v * beta2 + (1 - beta2) * g * g
#     p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
#
# The ops are elementwise, so the result does not depend on how the elements are split into
# tensors: the kernels run it on any slices of their storage. Kernel 1 below reproduces it.
def adam_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
    fused: bool | None = None,
) -> None:
    """One Adam(W) update in place on fp32 ``params`` (``step`` counts from 1).

    ``grads`` are fp32 and are not modified. ``exp_avgs``/``exp_avg_sqs`` may be fp32 or a
    16-bit dtype; 16-bit states are updated in fp32 and rounded back once per step.
    ``fused`` (default: on CUDA with fp32 states) runs PyTorch's fused Adam(W) kernel, one pass
    over params, grads and states instead of about ten; it agrees with the reference formulas
    to rounding, not bit for bit, so the CPU default stays on the reference path.
    """
    if not params:
        return
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if fused is None:
        fused = params[0].is_cuda and exp_avgs[0].dtype == torch.float32
    if fused:
        kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
        steps = [torch.tensor(float(step), device=params[0].device) for _ in params]
        kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    if weight_decay != 0:
        if decoupled_weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    low_precision = exp_avgs[0].dtype != torch.float32
    m = [t.float() for t in exp_avgs] if low_precision else exp_avgs
    v = [t.float() for t in exp_avg_sqs] if low_precision else exp_avg_sqs
    torch._foreach_lerp_(m, grads, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, m, denom, value=-step_size)
    if low_precision:
        torch._foreach_copy_(exp_avgs, m)
        torch._foreach_copy_(exp_avg_sqs, v)


class ReferenceKernel:
    """The step in PyTorch ops over flat state tensors: the reference the fused kernel is checked
    against, and what the FSDP2 engine runs.

    ``masters``, ``exp_avgs``, ``exp_avg_sqs`` are one flat tensor each per storage unit (a
    region of the flat engine, a parameter's local shard under FSDP2); ``runs[g]`` lists the
    (unit, lo, hi) ranges of param group g. Gradients are fp32 copies (clipping scales them in
    place), ``adam_`` updates the runs. An engine's kernel adds where its gradient shards are
    read from, the amax and the cast (``grad_shards``, ``local_amax``, ``cast``).
    """

    def __init__(self, masters: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                 exp_avg_sqs: Sequence[torch.Tensor], runs: list[list[Run]],
                 scaler: WeightQuantizers, device: torch.device) -> None:
        self.masters, self.exp_avgs, self.exp_avg_sqs = list(masters), list(exp_avgs), list(exp_avg_sqs)
        self.runs = runs
        self.fp8 = scaler
        self.device = device

    decides_on_device = False  # the optimizer reads the skip decision on the host first

    def grad_sumsq(self, shards: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in shards:
            if g.numel():
                total += torch.linalg.vector_norm(g).square()
        return total

    def clip_(self, grads: StepGrads, coef: torch.Tensor) -> None:
        torch._foreach_mul_(grads.shards, coef)

    def update(self, grads: StepGrads, hps: Sequence[AdamScalars]) -> None:
        for hp, runs in zip(hps, self.runs, strict=True):
            if not runs:
                continue
            adam_([self.masters[u][lo:hi] for u, lo, hi in runs],
                  [grads.shards[u][lo:hi] for u, lo, hi in runs],
                  [self.exp_avgs[u][lo:hi] for u, lo, hi in runs],
                  [self.exp_avg_sqs[u][lo:hi] for u, lo, hi in runs],
                  step=hp.step, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps,
                  weight_decay=hp.weight_decay, decoupled_weight_decay=hp.adam_w_mode)


# ============================================================================ tile table
@dataclasses.dataclass(frozen=True)
class TileTable:
    """Tiles of one region's local shard, sorted by (param group, local offset).

    Tile t covers master[local_start[t] : local_start[t] + numel[t]] and the same elements of the
    region's parameter and gradient buffers at param_start[t] (this rank's shard of a bucket).
    """

    block: int
    local_start: torch.Tensor
    """int64 (tiles,): offset in master / exp_avg / exp_avg_sq (this rank's concatenated shards)."""
    param_start: torch.Tensor
    """int64 (tiles,): offset in param_buffer / grad_buffer (region coordinates)."""
    numel: torch.Tensor
    """int32 (tiles,): 1..block."""
    slot: torch.Tensor
    """int64 (tiles,): the FP8 scale slot of the tile's parameter, -1 for a non-FP8 parameter."""
    param_index: torch.Tensor
    """int64 (tiles,): the tile's parameter (optimizer index)."""
    group_ranges: tuple[tuple[int, int, int], ...]
    """(param group, first tile, end tile) for each group with tiles, in group order."""
    align: int
    """Largest power of two <= 16 dividing every tile's local and param start (a kernel hint)."""

    @property
    def num_tiles(self) -> int:
        return int(self.local_start.numel())

    def to(self, device: torch.device | str) -> TileTable:
        move = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **move)

    def spans(self, first: int = 0, end: int | None = None) -> list[tuple[int, int, int, int]]:
        """Tiles ``[first, end)`` merged back into maximal runs of one parameter:
        (local_start, param_start, numel, slot) each (host lists; for the reference path)."""
        end = self.num_tiles if end is None else end
        lo = self.local_start[first:end].tolist()
        po = self.param_start[first:end].tolist()
        n = self.numel[first:end].tolist()
        sl = self.slot[first:end].tolist()
        pi = self.param_index[first:end].tolist()
        out: list[list[int]] = []
        last_pi = None
        for a, b, c, s, i in zip(lo, po, n, sl, pi, strict=True):
            if out and last_pi == i and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
                out[-1][2] += c
            else:
                out.append([a, b, c, s])
            last_pi = i
        return [(a, b, c, s) for a, b, c, s in out]


def build_tile_table(
    pieces: Sequence[ShardPiece],
    group_of: Mapping[int, int],
    slot_of: Mapping[int, int],
    block: int = DEFAULT_BLOCK,
    device: torch.device | str = "cpu",
) -> TileTable:
    """Cut ``pieces`` into tiles of at most ``block`` elements that never cross a piece.

    ``group_of`` maps a parameter index to its param group, ``slot_of`` to its FP8 scale slot
    (parameters missing from it get -1). Pure arithmetic on host tensors; moved to ``device``.
    """
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    order = sorted((pc for pc in pieces if pc.numel > 0),
                   key=lambda pc: (group_of[pc.param_index], pc.local_offset))
    i64 = torch.int64
    counts = torch.tensor([-(-pc.numel // block) for pc in order], dtype=i64)
    which = torch.repeat_interleave(torch.arange(len(order), dtype=i64), counts)
    first = torch.cumsum(counts, 0) - counts
    k = torch.arange(int(counts.sum()), dtype=i64) - first[which]
    off = k * block

    def per_piece(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=i64)[which] if order else torch.zeros(0, dtype=i64)

    local = per_piece([pc.local_offset for pc in order]) + off
    param = per_piece([pc.region_offset for pc in order]) + off
    numel = torch.clamp(per_piece([pc.numel for pc in order]) - off, max=block).to(torch.int32)
    slot = per_piece([slot_of.get(pc.param_index, -1) for pc in order])
    index = per_piece([pc.param_index for pc in order])
    group = per_piece([group_of[pc.param_index] for pc in order])
    ranges = []
    if order:
        gs, cnt = torch.unique_consecutive(group, return_counts=True)
        start = 0
        for g, c in zip(gs.tolist(), cnt.tolist(), strict=True):
            ranges.append((int(g), start, start + int(c)))
            start += int(c)
    align = math.gcd(16, block)  # tile starts are piece starts plus multiples of block
    for pc in order:
        align = math.gcd(align, pc.local_offset, pc.region_offset)
    return TileTable(block, local.to(device), param.to(device), numel.to(device), slot.to(device),
                     index.to(device), tuple(ranges), align)


# ============================================================================ the scalars
@dataclasses.dataclass(frozen=True)
class AdamScalars:
    """One param group's hyperparameters for one step, and the fp32 constants kernel 1 takes.

    The derived constants are computed on the host in double and rounded once to fp32, exactly as
    ``adam_``'s foreach calls round their Python scalars.
    """

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool = True

    @property
    def wd_mode(self) -> int:
        """0: no weight decay, 1: decoupled (AdamW), 2: L2 added to the gradient."""
        if self.weight_decay == 0:
            return 0
        return 1 if self.adam_w_mode else 2

    def kernel_args(self) -> dict[str, float]:
        t = self.step
        return {
            "decay": _f32(1 - self.lr * self.weight_decay),
            "weight_decay": _f32(self.weight_decay),
            "lerp_w": _f32(1 - self.beta1),
            "beta2": _f32(self.beta2),
            "one_minus_beta2": _f32(1 - self.beta2),
            "bc2_sqrt": _f32((1 - self.beta2**t) ** 0.5),
            "eps": _f32(self.eps),
            "neg_step_size": _f32(-(self.lr / (1 - self.beta1**t))),
        }

    @property
    def lerp_small(self) -> bool:
        """Which of torch.lerp's two formulas the moment update uses (|weight| < 0.5)."""
        return abs(_f32(1 - self.beta1)) < 0.5


# ============================================================================ the ops
def adam_tiles_(
    rb: RegionBuffers,
    table: TileTable,
    scalars: Sequence[AdamScalars],
    *,
    out_mode: int,
    grad_scale: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    partial_amax: torch.Tensor | None = None,
    fused_reference: bool | None = None,
    triton: bool | None = None,
    apply: torch.Tensor | None = None,
) -> None:
    """Kernel 1 on one region: Adam(W) on every tile, reading the gradient from ``rb.grad_buffer``.

    ``scalars[g]`` are param group g's hyperparameters. ``grad_scale``: a 0-d fp32 tensor the
    gradient is multiplied by first (the clipping coefficient), or None. ``out_mode``: OUT_AMAX /
    OUT_AMAX_CAST write ``partial_amax[tile]`` (fp32, one per tile) and, for OUT_AMAX_CAST, the
    FP8 bytes with ``scale[slot]``; OUT_PARAM writes the parameter shard in the buffer's dtype.
    ``fused_reference`` is passed to ``adam_`` as ``fused`` on the reference path (None: its
    default, which is what the optimizer runs without Triton). ``triton``: run the Triton kernel
    (True) or the reference ops (False); None asks ``use_triton`` (the optimizer decides once).
    ``apply``: a 0-d bool tensor; where False nothing is written (the Triton kernel reads it on
    the device, the reference ops on the host), [Note: skip on the device] in core.py.
    """
    if out_mode in (OUT_AMAX, OUT_AMAX_CAST) and (partial_amax is None or not rb.is_fp8):
        raise ValueError("the amax modes are for FP8 regions and need partial_amax")
    if out_mode == OUT_AMAX_CAST and scale is None:
        raise ValueError("OUT_AMAX_CAST needs the scales")
    if out_mode == OUT_PARAM and rb.is_fp8:
        raise ValueError("OUT_PARAM is for non-FP8 regions")
    if table.num_tiles == 0:
        return
    if use_triton(rb.master) if triton is None else triton:
        from fp8shard.optim import triton_adam

        fmt = rb.fmt
        for g, t0, t1 in table.group_ranges:
            triton_adam.launch_adam(
                rb.master, rb.exp_avg, rb.exp_avg_sq, rb.grad_buffer, rb.param_buffer, table, t0, t1,
                scalars[g], out_mode=out_mode, fmt=fmt, grad_scale=grad_scale, scale=scale,
                partial_amax=partial_amax, apply=apply)
        return
    if apply is not None and not bool(apply):
        return
    _adam_reference(rb, table, scalars, out_mode, grad_scale, scale, partial_amax, fused_reference)


def cast_tiles_(rb: RegionBuffers, table: TileTable, scale: torch.Tensor, triton: bool | None = None,
                apply: torch.Tensor | None = None) -> None:
    """Kernel 2 on one FP8 region: this rank's FP8 bytes from the master, ``scale[slot]`` per tile.
    ``triton`` and ``apply`` as for ``adam_tiles_``."""
    if not rb.is_fp8:
        raise ValueError("cast_tiles_ is for FP8 regions")
    if table.num_tiles == 0:
        return
    fmt = rb.fmt
    assert fmt is not None
    if use_triton(rb.master) if triton is None else triton:
        from fp8shard.optim import triton_adam

        triton_adam.launch_cast(rb.master, rb.param_buffer, table, scale, fmt, apply=apply)
        return
    if apply is not None and not bool(apply):
        return
    _cast_reference(rb, table, scale, fmt)


def slot_amax(tables: Sequence[TileTable], partials: Sequence[torch.Tensor | None], num_slots: int,
              device: torch.device) -> torch.Tensor:
    """Per-slot max of the tiles' partial amaxes (0 for a slot with no tile here): the same
    ``scatter_reduce(amax)`` that ``Fp8WeightScaler.local_amax`` applies to per-piece amaxes."""
    out = torch.zeros(num_slots, dtype=torch.float32, device=device)
    for table, partial in zip(tables, partials, strict=True):
        if partial is None or table.num_tiles == 0:
            continue
        out.scatter_reduce_(0, table.slot, partial, reduce="amax")
    return out


# ============================================================================ reference path
def _adam_reference(rb: RegionBuffers, table: TileTable, scalars: Sequence[AdamScalars], out_mode: int,
                    grad_scale: torch.Tensor | None, scale: torch.Tensor | None,
                    partial_amax: torch.Tensor | None, fused: bool | None) -> None:
    """What kernel 1 computes, with ``adam_`` (so: what the optimizer computes without Triton)."""
    for g, t0, t1 in table.group_ranges:
        spans = table.spans(t0, t1)
        sl = [slice(a, a + n) for a, _, n, _ in spans]
        grads = [rb.grad_buffer[b:b + n].to(torch.float32, copy=True) for _, b, n, _ in spans]
        if grad_scale is not None:
            torch._foreach_mul_(grads, grad_scale)
        hp = scalars[g]
        adam_([rb.master[s] for s in sl], grads, [rb.exp_avg[s] for s in sl],
              [rb.exp_avg_sq[s] for s in sl], step=hp.step, lr=hp.lr, beta1=hp.beta1,
              beta2=hp.beta2, eps=hp.eps, weight_decay=hp.weight_decay,
              decoupled_weight_decay=hp.adam_w_mode, fused=fused)
    if out_mode in (OUT_AMAX, OUT_AMAX_CAST):
        assert partial_amax is not None
        lo, n = table.local_start.tolist(), table.numel.tolist()
        views = [rb.master[a:a + c] for a, c in zip(lo, n, strict=True)]
        partial_amax.copy_(torch.stack(torch._foreach_norm(views, float("inf"))).float())
    if out_mode == OUT_AMAX_CAST:
        assert scale is not None
        _cast_reference(rb, table, scale, rb.fmt)
    elif out_mode == OUT_PARAM:
        for a, b, n, _ in table.spans():
            rb.param_buffer[b:b + n].copy_(rb.master[a:a + n])


_PER_TENSOR = TensorwiseQuantizer()
"""The fused step's weights are per tensor (current or delayed: one cast): kernel 2's reference op is
this quantizer's ``cast_scaled``, one call per run of a parameter with its slot's scale."""


def _cast_reference(rb: RegionBuffers, table: TileTable, scale: torch.Tensor, fmt: Fp8Format) -> None:
    for a, b, n, s in table.spans():
        _PER_TENSOR.cast_scaled(rb.master[a:a + n], scale[s], fmt, "weight", out=rb.param_buffer[b:b + n])


# ============================================================================ the optimizer's use
def sumsq_in_place(shards: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d fp32 sum of squares of the gradient shards, read in their dtype (16-bit: upcast
    inside the norm kernel, no fp32 copy)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    shards = [g for g in shards if g.numel()]
    if shards:
        total += torch.stack(torch._foreach_norm(shards, 2, dtype=torch.float32)).square().sum()
    return total


class FusedKernel:
    """The step kernel ([Note: step kernel] in step_kernel.py) of the fused step: kernel 1 and 2
    over the tile tables of every region (built once, here), Triton or the reference ops as
    ``use_triton`` says at construction.

    The gradient is read in place from the bucket buffers (``grad_sync_dtype``, no fp32 copy);
    clipping records a coefficient that kernel 1 applies as it reads. Kernel 1 also writes the
    non-FP8 parameters, and with delayed scaling (scales known before the amax) the FP8 bytes.
    Both kernels take the step's skip flag (``grads.apply``) and read it on the device
    ([Note: skip on the device] in core.py).
    """

    decides_on_device = True

    def __init__(self, regions: Sequence[RegionBuffers], group_of: Mapping[int, int],
                 scaler: WeightQuantizers, block: int = DEFAULT_BLOCK) -> None:
        if scaler.tiled:
            raise ValueError("step_kernel='fused' casts per-tensor FP8 weights only; these are rowwise or "
                             "blockwise ([Note: tiled weight casts]): use step_kernel='reference' or 'auto'")
        self.regions = list(regions)
        self.fp8 = scaler
        self.device = self.regions[0].master.device
        self.triton = use_triton(self.regions[0].master)
        self.tables = [build_tile_table(rb.pieces, group_of, scaler.slot if rb.is_fp8 else {}, block,
                                        rb.master.device) for rb in self.regions]
        self.partials = [torch.zeros(t.num_tiles, dtype=torch.float32, device=rb.master.device)
                         if rb.is_fp8 else None for rb, t in zip(self.regions, self.tables, strict=True)]
        # (region, start, numel) of this rank's shard of every bucket in the grad buffers, which
        # are a new allocation each step ([Note: gradient regions]): the views are made per step.
        self._grad_shards = [(ri, b.shard_start(rb.rank), b.shard_numel) for ri, rb in enumerate(self.regions)
                             for b in rb.layout.buckets]

    def grad_shards(self) -> list[torch.Tensor]:
        grads = [rb.grad_buffer for rb in self.regions]
        return [grads[ri][s:s + n] for ri, s, n in self._grad_shards]

    def grad_sumsq(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return sumsq_in_place(shards, self.device)

    def clip_(self, grads: StepGrads, coef: torch.Tensor) -> None:
        grads.coef = coef if grads.coef is None else grads.coef * coef

    def update(self, grads: StepGrads, hps: Sequence[AdamScalars]) -> None:
        """Kernel 1 on every region (and the cast, when the scales are known before the amax)."""
        known = self.fp8.known_scales()
        for rb, table, partial in zip(self.regions, self.tables, self.partials, strict=True):
            if rb.is_fp8:
                mode = OUT_AMAX if known is None else OUT_AMAX_CAST
            else:
                mode = OUT_PARAM
            adam_tiles_(rb, table, hps, out_mode=mode, grad_scale=grads.coef, scale=known,
                        partial_amax=partial, triton=self.triton, apply=grads.apply)

    def local_amax(self) -> torch.Tensor:
        return slot_amax(self.tables, self.partials, self.fp8.num_slots, self.device)

    def cast(self, scales: torch.Tensor, grads: StepGrads) -> None:
        """Kernel 2 on every FP8 region (current scaling; delayed scaling cast in kernel 1)."""
        if self.fp8.known_scales() is not None:
            return
        for rb, table in zip(self.regions, self.tables, strict=True):
            if rb.is_fp8:
                cast_tiles_(rb, table, scales, triton=self.triton, apply=grads.apply)

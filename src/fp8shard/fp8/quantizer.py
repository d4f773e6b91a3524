"""The quantizer protocol: what one FP8 scaling recipe is, so that recipes are additions.

Here, in order: [Note: scale] written once (the encoding ``cast_to_fp8``, which every FP8 cast
applies with its scales, and the scale rule ``scale_from_amax``, ``amax``, ``AmaxHistory``); the
protocol; the per-tensor quantizers; ``WeightQuantizers``, an optimizer's FP8 weights through
their quantizers ([Note: weight scaling]); ``quantizer_for``, a recipe's quantizer. The rowwise
and blockwise quantizers build on this in ``fp8/tiled.py``, the recipes and their names
(``parse_recipe``) are in ``fp8/scaling.py``; this module still exports their names.

[Note: quantizer]
    Every GEMM operand is seen as a 2-D ``[R, C]`` tensor whose **last dim C is the contraction
    dim** ([Note: three GEMMs]):

        forward  y  = x · Wᵀ      operands x [T, in],   W  [out, in]    (C = in)
        dgrad    dx = dy · W      operands dy [T, out], Wᵀ [in, out]    (C = out)
        wgrad    dW = dyᵀ · x     operands dyᵀ [out, T], xᵀ [in, T]     (C = T)

    and every product is ``gemm(a, b) = a · bᵀ`` of two such operands ([M, K] and [N, K]). A
    recipe gives each operand one scale per tile of ``(br, bc)`` elements. Within one dot
    product (a row of ``a`` with a row of ``b``) a scale must be constant over K, or over each
    K-block the kernel sums separately: then it factors out of that partial sum and the
    hardware applies it after the FP8 products (rowwise: once per output; blockwise: once per
    128-long K-block). Hence tiles run *along* C, never across rows of the sum.

    | recipe | activations, gradients | weights | scale_inv shape of [R, C] |
    |---|---|---|---|
    | tensorwise (current or delayed) | whole tensor | whole tensor | 0-d |
    | rowwise (torchao) | (1, C): per row | (1, C): per row | [R, 1] |
    | blockwise (DeepSeek-V3) | (1, 128) | (128, 128) | [ceil(R/br), ceil(C/bc)] |

    Because the scale runs along C, the same tensor needs other scales for each GEMM it feeds:
    x is cast per row of x for the forward and per row of xᵀ (per column of x) for wgrad, W per
    row of W and per row of Wᵀ. A 128x128 block of Wᵀ is the transpose of a block of W, so for
    blockwise weights the two casts hold the same values (bytes and scales transposed).

    What a recipe provides (``Quantizer``): ``local_stats`` (the amax of every tile of this
    rank's tensor), ``reduce`` (a MAX all-reduce of those, for tensors split over ranks),
    ``scales`` (the recipe's rule from the reduced stats, [Note: scale], elementwise per tile;
    per tensor with the previous-scale guard), ``cast_scaled`` (FP8 bytes with given scales),
    ``cast`` (the two: stats -> scales -> FP8 bytes + ``scale_inv``) and ``gemm`` for the
    operands it produced. ``quantize`` is current scaling: stats of the tensor being cast, then
    the cast. ``fs.nn.Linear`` computes rowwise and blockwise through it
    (``nn/quantized_linear.py``). The optimizer casts every FP8 weight through it
    (``WeightQuantizers``): per-tensor weights with ``TensorwiseQuantizer`` (current) or
    ``DelayedTensorwiseQuantizer`` (delayed: an ``AmaxHistory``, ``ahead``: a cast's scales
    come from the stats before it; ``state`` keeps the history in checkpoints), rowwise and
    blockwise ones with their tile quantizers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist

# fused (the fused per-tensor casts) is built on this module's encoding and scale rule, and the
# tensorwise quantizer on fused: each reads the other through a module reference, when called, so
# either may be imported first.
from fp8shard.fp8 import fused as _fused
from fp8shard.fp8 import gemm as _gemm
from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.scaling import (
    RECIPE_NAMES,
    BlockwiseScaling,
    DelayedScaling,
    Recipe,
    RowwiseScaling,
    is_tiled,
    parse_recipe,
)

if TYPE_CHECKING:
    from fp8shard.fp8.tensor import Float8Tensor
    from fp8shard.fp8.tiled import BlockwiseQuantizer, RowwiseQuantizer

OperandKind = Literal["activation", "weight"]
"""Activations and gradients are "activation"; only blockwise treats weights differently."""
KINDS = ("activation", "weight")


# ------------------------------------------------------------------------------ the encoding, the scale rule
def cast_to_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: Fp8Format,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``saturate(round(x * scale))`` as ``fmt.torch_dtype``; writes into ``out`` if given.

    The product is taken in fp32; ``clamp`` saturates +-inf to +-max and leaves NaN as NaN;
    PyTorch's float8 conversion rounds to nearest even. ``out`` may be a float8 tensor of
    ``fmt`` or a ``uint8`` tensor (the same bytes, as collectives move them).
    """
    hp = x.float() * scale.float()
    lp = hp.clamp_(-fmt.max, fmt.max).to(fmt.torch_dtype)
    if out is None:
        return lp
    if out.dtype == torch.uint8:
        out.copy_(lp.view(torch.uint8))
    else:
        out.copy_(lp)
    return out


def cast_from_fp8(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                  scale_first: bool = False) -> torch.Tensor:
    """``data * scale_inv`` in fp32, returned as ``dtype``. ``scale_first``: the same bits
    written as ``scale_inv * data`` (IEEE products commute; [Note: dequantize again])."""
    if scale_first:
        return (scale_inv.float() * data.float()).to(dtype)
    return (data.float() * scale_inv.float()).to(dtype)


def scale_from_amax(
    amax: torch.Tensor,
    fmt_max: float | torch.Tensor,
    prev_scale: torch.Tensor | None = None,
    margin: int = 0,
) -> torch.Tensor:
    """fp32 scale(s) ``fmt_max / amax / 2**margin`` with the guards of [Note: scale].

    Works elementwise, so a packed vector of amaxes gives a vector of scales in one call.
    """
    amax = amax.float()
    scale = (fmt_max / amax) / (2.0**margin)
    prev = torch.ones_like(amax) if prev_scale is None else prev_scale.float()
    # isfinite(amax) & amax > 0 & isfinite(scale) & scale > 0, in four comparisons (NaN fails
    # each; torch.isfinite is three kernels of its own on CUDA, and this runs in every step)
    ok = (amax > 0) & (amax < math.inf) & (scale > 0) & (scale < math.inf)
    return torch.where(ok, scale, prev)


def amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 0-d max |x|; 0 for an empty tensor; NaN if x holds a NaN."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    x = x.detach()
    # torch.max and amax propagate NaN, so a NaN in x shows up as a non-finite amax.
    if x.dim() >= 2 and x.shape[-1] > 1:
        # [Note: two-level amax] Rows first, then the row maxima: the same value (max is exact
        # and order-free), but under torch.compile Inductor emits a row reduction, one program
        # per block of rows reading memory in order, instead of one split reduction of the
        # whole tensor, which measured at a quarter to a third of the GPU's read bandwidth on
        # the 1.3B GPT's activations (docs/performance.md, section 9).
        return x.abs().amax(dim=-1).max().float()
    return x.abs().max().float()


class AmaxHistory:
    """Delayed-scaling state for ``n`` tensor slots: an amax history and a scale per slot.

    Protocol (Transformer Engine's): casts in iteration i use ``scale`` and record their amax
    into ``history[0]`` with :meth:`record`; after the iteration (and after the amaxes were
    reduced over the group, if any) :meth:`update` computes new scales from the whole window
    and rolls the window so ``history[0]`` is free for the next iteration.
    """

    def __init__(self, n: int, recipe: DelayedScaling, fmt_max: torch.Tensor | float,
                 device: torch.device | str | None = None) -> None:
        self.recipe = recipe
        self.history = torch.zeros(recipe.amax_history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.fmt_max = torch.as_tensor(fmt_max, dtype=torch.float32, device=device)

    def record(self, slot: int, amax_value: torch.Tensor) -> None:
        cur = self.history[0, slot]
        self.history[0, slot] = torch.maximum(cur, amax_value.float())

    def update(self) -> torch.Tensor:
        if self.recipe.amax_compute_algo == "max":
            window_amax = self.history.amax(dim=0)
        else:
            window_amax = self.history[0]
        self.scale = scale_from_amax(window_amax, self.fmt_max, self.scale, self.recipe.margin)
        self.history = torch.roll(self.history, shifts=-1, dims=0)
        self.history[0].zero_()
        return self.scale

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"amax_history": self.history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if sd["amax_history"].shape != self.history.shape:
            raise ValueError(
                f"amax history shape {tuple(sd['amax_history'].shape)} does not match "
                f"{tuple(self.history.shape)}: was amax_history_len changed?"
            )
        self.history.copy_(sd["amax_history"])
        self.scale.copy_(sd["scale"])


class Fp8Operand(NamedTuple):
    """One GEMM operand in FP8: ``data`` [R, C] row-major, contraction dim C last."""

    data: torch.Tensor
    """FP8 bytes [R, C]."""
    scale_inv: torch.Tensor
    """fp32 inverse scales: 0-d (tensorwise) or [ceil(R/br), ceil(C/bc)] for ``block``."""
    block: tuple[int, int] | None
    """(br, bc): the elements one scale covers; None for one scale over the whole tensor."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values the bytes stand for, ``data * scale_inv`` per tile, as ``dtype``."""
        if self.block is None:
            return (self.data.float() * self.scale_inv.float()).to(dtype)
        from fp8shard.fp8.tiled import mul_tiles

        return mul_tiles(self.data, self.scale_inv.float(), self.block).to(dtype)


@runtime_checkable
class Quantizer(Protocol):
    """What one scaling recipe provides ([Note: quantizer])."""

    name: str
    ahead: bool
    """Whether a cast's scales are known before its own stats (delayed scaling)."""

    def local_stats(self, x: torch.Tensor, kind: OperandKind) -> torch.Tensor:
        """fp32 amax of every tile of the 2-D ``x`` (0-d for tensorwise)."""
        ...

    def reduce(self, stats: torch.Tensor, group: Any = None) -> torch.Tensor:
        """``stats`` MAX-reduced over ``group`` in place (no-op without a process group)."""
        ...

    def scales(self, stats: torch.Tensor, fmt: Fp8Format, prev: torch.Tensor | None = None,
               apply: torch.Tensor | None = None) -> torch.Tensor:
        """The recipe's rule: fp32 scales from the (reduced) ``stats``, elementwise, so a packed
        vector of several tensors' stats gives their scales in one call. ``prev``: the scales in
        use, which the per-tensor rule keeps where an amax is zero or non-finite. ``apply``: a
        0-d bool tensor; where False a quantizer that keeps state (an amax history) leaves it as
        it was (the optimizer's step skipped on the device, [Note: skip on the device])."""
        ...

    def cast_scaled(self, x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, kind: OperandKind,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """FP8 bytes of ``x`` with the given ``scales`` (0-d or per tile), into ``out`` if given."""
        ...

    def cast(self, x: torch.Tensor, stats: torch.Tensor, fmt: Fp8Format, kind: OperandKind) -> Fp8Operand:
        """FP8 bytes and ``scale_inv`` of ``x`` with scales from the (reduced) ``stats``."""
        ...

    def state(self, col: int) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of tensor ``col`` beside its scales (delayed: its amax history)."""
        ...

    def load_state(self, col: int, sd: dict[str, torch.Tensor], what: str) -> None:
        """``state``'s entries of tensor ``col`` from ``sd`` (``what`` names it in errors)."""
        ...

    def quantize(self, x: torch.Tensor, fmt: Fp8Format, kind: OperandKind, *, rows: bool = True,
                 cols: bool = False) -> tuple[Fp8Operand | None, Fp8Operand | None]:
        """Current scaling of the 2-D ``x``: ``rows`` the operand x (contraction along x's
        columns), ``cols`` the operand xᵀ (contraction along x's rows); None where not asked."""
        ...

    def gemm(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """``a · bᵀ (+ bias)`` as ``out_dtype``: a [M, K], b [N, K] from this quantizer."""
        ...


def _reduce_max(stats: torch.Tensor, group: Any) -> torch.Tensor:
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    return stats


def _check_2d(x: torch.Tensor, who: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{who}: a GEMM operand is 2-D [rows, contraction], got shape {tuple(x.shape)}; "
                         f"flatten leading dims first (x.reshape(-1, x.shape[-1]))")


# ------------------------------------------------------------------------------ tensorwise
class TensorwiseQuantizer:
    """Per-tensor scaling: today's casts (``fp8/fused.py``) and GEMM (``fp8_mm``) as a quantizer.

    ``quantize`` is one fused cast ([Note: fused cast]); with ``cols`` the transposed bytes
    come from the same pass and share the one scale.
    """

    name = "tensorwise"
    ahead = False

    def local_stats(self, x: torch.Tensor, kind: OperandKind) -> torch.Tensor:
        return amax(x)

    def reduce(self, stats: torch.Tensor, group: Any = None) -> torch.Tensor:
        return _reduce_max(stats, group)

    def scales(self, stats: torch.Tensor, fmt: Fp8Format, prev: torch.Tensor | None = None,
               apply: torch.Tensor | None = None) -> torch.Tensor:
        # no state to keep (apply): the caller keeps its scales where the step is skipped
        # fmt.max a Python float: ``float / tensor`` is what Float8Tensor.quantize divides by
        return scale_from_amax(stats, fmt.max, prev)  # [Note: scale]

    def cast_scaled(self, x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, kind: OperandKind,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        return cast_to_fp8(x.detach(), scale, fmt, out=out)

    def cast(self, x: torch.Tensor, stats: torch.Tensor, fmt: Fp8Format, kind: OperandKind) -> Fp8Operand:
        c = _fused.quantize_with_scale(x, self.scales(stats, fmt), fmt)
        return Fp8Operand(c.data, c.scale_inv, None)

    def state(self, col: int) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of tensor ``col`` beside its scales: nothing (current scaling)."""
        return {}

    def load_state(self, col: int, sd: dict[str, torch.Tensor], what: str) -> None:
        """Nothing to load beside the scales (current scaling)."""

    def quantize(self, x: torch.Tensor, fmt: Fp8Format, kind: OperandKind, *, rows: bool = True,
                 cols: bool = False) -> tuple[Fp8Operand | None, Fp8Operand | None]:
        _check_2d(x, "TensorwiseQuantizer.quantize")
        c = _fused.quantize_current(x, fmt, transpose=cols)
        op_rows = Fp8Operand(c.data, c.scale_inv, None) if rows else None
        op_cols = Fp8Operand(c.data_t, c.scale_inv, None) if cols else None
        return op_rows, op_cols

    def gemm(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        _check_pair(a, b)
        return _gemm.fp8_mm(a.data, a.scale_inv, b.data.t(), b.scale_inv, out_dtype, bias)


class DelayedTensorwiseQuantizer(TensorwiseQuantizer):
    """Per-tensor delayed scaling of ``n`` tensors (the optimizer's weights with
    ``fp8_weight_scaling='delayed'``): the tensorwise quantizer with an ``AmaxHistory``.

    ``scales(stats, fmt, prev)`` records the (reduced) ``stats`` into the history and returns
    the scales for the NEXT cast from the window ([Note: scale], margin and algorithm of the
    recipe; ``prev``, the scales in use, where an amax is zero or non-finite): a cast uses the
    scales known before its own stats (``ahead``).
    """

    name = "delayed"
    ahead = True

    def __init__(self, n: int, recipe: DelayedScaling, fmt: Fp8Format,
                 device: torch.device | str | None = None) -> None:
        self.history = AmaxHistory(n, recipe, torch.full((n,), fmt.max), device=device)

    def scales(self, stats: torch.Tensor, fmt: Fp8Format, prev: torch.Tensor | None = None,
               apply: torch.Tensor | None = None) -> torch.Tensor:
        h = self.history
        if prev is not None:
            h.scale = prev
        before = (h.history.clone(), h.scale) if apply is not None else None
        torch.maximum(h.history[0], stats, out=h.history[0])
        new = h.update()
        if before is not None:  # a step skipped on the device: the window and scales stay
            h.history = torch.where(apply, h.history, before[0])
            h.scale = new = torch.where(apply, new, before[1])
        return new

    def state(self, col: int) -> dict[str, torch.Tensor]:
        """Tensor ``col``'s amax history (its checkpoint entry beside the scale)."""
        return {"amax_history": self.history.history[:, col].clone()}

    def load_state(self, col: int, sd: dict[str, torch.Tensor], what: str) -> None:
        if "amax_history" not in sd:
            raise ValueError(f"{what}: checkpoint has no amax_history, but "
                             "fp8_weight_scaling='delayed' needs one; load with 'current' scaling")
        hist = sd["amax_history"].to(self.history.history)
        if hist.shape[0] != self.history.history.shape[0]:
            raise ValueError(f"{what}: amax history of length {hist.shape[0]} does not "
                             f"match amax_history_len={self.history.history.shape[0]}")
        self.history.history[:, col] = hist



def _check_kind(kind: str) -> OperandKind:
    if kind not in KINDS:
        raise ValueError(f"unknown operand kind {kind!r}; choose one of {', '.join(KINDS)} "
                         f"(gradients are 'activation')")
    return kind  # type: ignore[return-value]


def _check_pair(a: Fp8Operand, b: Fp8Operand) -> None:
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"gemm(a, b) = a · bᵀ needs a [M, K] and b [N, K] with the same K, got "
                         f"{tuple(a.data.shape)} and {tuple(b.data.shape)}")


# ------------------------------------------------------------------------------ an optimizer's weights
ScalingMode = Literal["current", "delayed"]


class _Group(NamedTuple):
    """FP8 weights whose scales one quantizer computes in one call."""

    quantizer: Quantizer
    fmt: Fp8Format
    slots: torch.Tensor
    """int64: the group's slots, in order (the quantizer's columns)."""
    run: slice | None
    """The same slots as a slice where they are one contiguous run (a view instead of a gather)."""


class _ScaleStage:
    """``set_scale_inv``'s per-call state for one set of weights, made once: the slots to pick
    and two fp32 staging buffers with views shaped like the weights' ``_scale_inv``s."""

    def __init__(self, spans: list[tuple[int, int]], shapes: list[torch.Size], device: torch.device) -> None:
        self.idx = torch.cat([torch.arange(s, s + k) for s, k in spans]).to(device)
        self.new = torch.empty(self.idx.numel(), dtype=torch.float32, device=device)
        self.old = torch.empty_like(self.new)
        sizes = [k for _, k in spans]
        self.new_views, self.old_views = (
            [v.view(shape) for v, shape in zip(buf.split(sizes), shapes, strict=True)]
            for buf in (self.new, self.old))


class WeightQuantizers:
    """The quantizers of an optimizer's FP8 weights, and their scales ([Note: weight scaling]).

    One slot per per-tensor weight (ordered by index), then one per tile of each rowwise or
    blockwise one ([Note: tiled weight casts] in ``optim/fp8_weights.py``). Each weight's
    quantizer is chosen once, here, for every recipe alike: weights of one format share one (a
    column each, one ``scales`` call for them all), the per-tensor ones, and the tiled ones by
    their kind of tile (rows, or n x n blocks).
    A step takes every recipe through the same sequence: the engine's kernel computes each
    piece's ``local_stats`` of the new master, the optimizer all-reduces them (MAX, one packed
    call), ``cast_scales`` applies every quantizer's ``scales``, the kernel casts each piece
    with ``cast_scaled``, and ``set_scale_inv`` gives the weights their new scales once their
    bytes land. Per-tensor scaling is one implementation of the protocol, not a branch:

    * ``current`` (default, ``TensorwiseQuantizer``): the cast at step t uses
      ``scale = fmt.max / global_amax(master_t)``; a zero or non-finite amax keeps the previous
      scale.
    * ``delayed`` (``DelayedTensorwiseQuantizer``, Transformer Engine's recipe, for parity with
      the anchors): the cast at step t uses the scale computed from the amax history *before*
      step t; the global amax of master_t is then recorded and the scale for step t+1
      computed from the window.
    """

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
        # Weights of one format share a quantizer, one ``scales`` call for them all: the per-tensor
        # ones, and the tiled ones by their kind of tile (rows, or n x n blocks), whose stateless
        # quantizers take each tile's scale from its own amax whatever the weight's shape.
        members: dict[tuple[object, ...], list[int]] = {}
        for i in self.span:
            p = params[i]
            kind = ("tensor",) if p.block is None else ("tiles", p.block[0] == 1 or p.block[0])
            members.setdefault((*kind, p.fp8_format), []).append(i)
        self.groups: list[_Group] = []
        self._col: dict[int, tuple[Quantizer, int]] = {}  # weight -> (its quantizer, its column)
        for idx in members.values():
            p = params[idx[0]]
            q = _choose_quantizer(p, mode, recipe, len(idx), device)
            slots = [s for i in idx for s in range(self.span[i][0], sum(self.span[i]))]
            run = (slice(slots[0], slots[-1] + 1) if slots and slots == list(range(slots[0], slots[-1] + 1))
                   else None)
            index = torch.tensor(slots, dtype=torch.long, device=device)
            self.groups.append(_Group(q, p.fp8_format, index, run))
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
        self._ready: dict[tuple[int, ...], _ScaleStage] = {}
        # The leading slots a step MAX-reduces over the group: all of them here (the flat engine's
        # ranks hold pieces of the weights); an engine whose ranks hold whole tiles reduces fewer.
        self.reduced_slots = n

    @property
    def num_slots(self) -> int:
        return int(self.scale.numel())

    def as_tiles(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """The flat values of FP8 parameter ``index`` as its quantizer sees them: 2-D [rows,
        cols] (a per-tensor weight: one row)."""
        return flat.view(-1, self._geometry[index][0])

    def quantizer(self, index: int) -> Quantizer:
        """The quantizer of FP8 parameter ``index``."""
        return self._col[index][0]

    def known_scales(self) -> torch.Tensor | None:
        """The scales this step's cast will use, when they are known before this step's amax
        (delayed scaling: the scales its quantizer computed from the history before step t), else
        None (current scaling needs the global amax of the new master first). The fused step
        casts in its Adam pass when they are known ([Note: fused step])."""
        return self.scale if self._ahead else None

    def cast_scales(self, global_amax: torch.Tensor, apply: torch.Tensor | None = None) -> torch.Tensor:
        """The scales to cast this step's master with (and advance the scaling state): every
        group's quantizer's ``scales`` from the reduced stats, the scales in use as ``prev``.
        Delayed: the cast uses the scales from before; the new ones serve the next step.
        ``apply`` (0-d bool): where False the scaling state stays as it was ([Note: skip on the
        device]; the cast that would use the returned scales writes nothing then)."""
        # ``prev`` is always a copy: a stateful quantizer (delayed) keeps it as its own state
        if len(self.groups) == 1 and self.groups[0].run == slice(0, self.num_slots):
            g = self.groups[0]  # one call over every slot: no gather, no scatter
            new = g.quantizer.scales(global_amax, g.fmt, self.scale.clone(), apply=apply)
        else:
            new = self.scale.clone()
            for g in self.groups:
                at = g.run if g.run is not None else g.slots
                new[at] = g.quantizer.scales(global_amax[at], g.fmt, self.scale[at].clone(), apply=apply)
        if apply is not None:
            new = torch.where(apply, new, self.scale)
        used = self.scale if self._ahead else new
        self.scale = new
        return used

    def set_scale_inv(self, params: dict[int, Float8Tensor], scale_inv: torch.Tensor,
                      apply: torch.Tensor | None = None) -> None:
        """Give ``params`` (their bytes just gathered) their slots of ``scale_inv`` (the inverse
        of ``cast_scales``'s result) in one batched copy, and drop their cached transposes.
        ``apply`` (0-d bool): where False each keeps its own (the step was skipped on the device
        and its bytes did not change, [Note: skip on the device]).

        The per-call host work is a handful of batched ops whatever the number of weights: the
        slot indices and two staging buffers (with views shaped like the weights' scales) are
        made once per set of weights; a step gathers the new scales into one, the weights'
        current ones into the other (for ``apply``), and copies back with one foreach copy."""
        stage = self._ready.get(tuple(params))
        if stage is None:
            stage = self._ready[tuple(params)] = _ScaleStage(
                [self.span[i] for i in params], [p._scale_inv.shape for p in params.values()],
                scale_inv.device)
        dst = [p._scale_inv for p in params.values()]
        torch.index_select(scale_inv, 0, stage.idx, out=stage.new)
        if apply is not None:
            torch._foreach_copy_(stage.old_views, dst)
            torch.where(apply, stage.new, stage.old, out=stage.new)
        torch._foreach_copy_(dst, stage.new_views)
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
        from fp8shard.fp8.tiled import weight_quantizer

        return weight_quantizer(p.block)
    if mode == "delayed":
        return DelayedTensorwiseQuantizer(n, recipe, p.fp8_format, device=device)
    return TensorwiseQuantizer()


def _geometry(p: Float8Tensor) -> tuple[int, int, int, tuple[int, ...]]:
    """(cols, block rows, grid cols, scale shape) of ``p`` as its quantizer sees it."""
    if p.block is None:
        return max(p.numel(), 1), 1, 1, ()
    return p.shape[1], p.block[0], p._scale_inv.shape[1], tuple(p._scale_inv.shape)


# ------------------------------------------------------------------------------ a recipe's quantizer
def quantizer_for(recipe: Recipe | str) -> TensorwiseQuantizer | RowwiseQuantizer | BlockwiseQuantizer:
    """The quantizer of a recipe (delayed scaling's per-layer state stays in ``fs.nn.Linear``)."""
    from fp8shard.fp8.tiled import BlockwiseQuantizer, RowwiseQuantizer  # tiled.py builds on this module

    recipe = parse_recipe(recipe)
    if isinstance(recipe, RowwiseScaling):
        return RowwiseQuantizer(power_of_2_scales=recipe.power_of_2_scales)
    if isinstance(recipe, BlockwiseScaling):
        return BlockwiseQuantizer(recipe.block_size, power_of_2_scales=recipe.power_of_2_scales)
    return TensorwiseQuantizer()


_TILED = ("BlockwiseQuantizer", "RowwiseQuantizer", "cast_tiles", "emulated_tiled_mm", "mul_tiles",
          "quantize_tiles", "tile_amax", "tile_scales", "weight_block", "weight_quantizer")


def __getattr__(name: str) -> object:
    """The tiled quantizers' names, from ``fp8/tiled.py``, as before."""
    if name in _TILED:
        from fp8shard.fp8 import tiled

        return getattr(tiled, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AmaxHistory", "DelayedTensorwiseQuantizer", "Fp8Operand", "OperandKind", "Quantizer", "RECIPE_NAMES",
    "ScalingMode", "TensorwiseQuantizer", "WeightQuantizers", "amax", "cast_from_fp8", "cast_to_fp8",
    "is_tiled", "parse_recipe", "quantizer_for", "scale_from_amax",
]

"""The quantizer protocol: what one FP8 scaling recipe is, so that recipes are additions.

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
    (``nn/quantized_linear.py``). The optimizer casts every FP8 weight through it ([Note: weight
    scaling] in ``optim/fp8_weights.py``): per-tensor weights with ``TensorwiseQuantizer``
    (current) or ``DelayedTensorwiseQuantizer`` (delayed: an ``AmaxHistory``, ``ahead``: a
    cast's scales come from the stats before it; ``state`` keeps the history in checkpoints),
    rowwise and blockwise ones with their tile quantizers. The scale rule (``scale_from_amax``,
    ``amax``, ``AmaxHistory``) is written here, once.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F

# fused (the fused per-tensor casts) imports this module's scale rule: a module reference, read
# when called, keeps the two importable in either order.
from fp8shard.fp8 import fused as _fused
from fp8shard.fp8 import gemm as _gemm
from fp8shard.fp8.cast import cast_to_fp8
from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.scaling import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Recipe,
    RowwiseScaling,
)

OperandKind = Literal["activation", "weight"]
"""Activations and gradients are "activation"; only blockwise treats weights differently."""
KINDS = ("activation", "weight")


# ------------------------------------------------------------------------------ the scale rule
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
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale) & (scale > 0)
    return torch.where(ok, scale, prev)


def amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 0-d max |x|; 0 for an empty tensor; NaN if x holds a NaN."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # torch.max propagates NaN, so a NaN in x shows up as a non-finite amax.
    return x.detach().abs().max().float()




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

    def scales(self, stats: torch.Tensor, fmt: Fp8Format, prev: torch.Tensor | None = None) -> torch.Tensor:
        """The recipe's rule: fp32 scales from the (reduced) ``stats``, elementwise, so a packed
        vector of several tensors' stats gives their scales in one call. ``prev``: the scales in
        use, which the per-tensor rule keeps where an amax is zero or non-finite."""
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

    def scales(self, stats: torch.Tensor, fmt: Fp8Format, prev: torch.Tensor | None = None) -> torch.Tensor:
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

    def scales(self, stats: torch.Tensor, fmt: Fp8Format, prev: torch.Tensor | None = None) -> torch.Tensor:
        h = self.history
        if prev is not None:
            h.scale = prev
        torch.maximum(h.history[0], stats, out=h.history[0])
        return h.update()

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


# ------------------------------------------------------------------------------ tiled recipes
def _tiles(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The 2-D ``x`` as tiles: [rb, br, cb, bc], zero-padded to whole tiles (a view if none)."""
    rows, cols = x.shape
    br, bc = block
    rb, cb = -(-rows // br), -(-cols // bc)
    if rb * br != rows or cb * bc != cols:
        x = F.pad(x, (0, cb * bc - cols, 0, rb * br - rows))
    return x.reshape(rb, br, cb, bc)


def _untile(t: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """[rb, br, cb, bc] tiles back to a contiguous [R, C] (padding dropped)."""
    rb, br, cb, bc = t.shape
    return t.reshape(rb * br, cb * bc)[: shape[0], : shape[1]].contiguous()


def tile_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 max |x| of every ``block`` tile of the 2-D ``x``: [ceil(R/br), ceil(C/bc)].

    Partial tiles at the edges are padded with zeros (they never raise a max); a NaN in a tile
    gives that tile a NaN amax, as ``amax`` does for a whole tensor.
    """
    return _tiles(x.detach().abs().float(), block).amax(dim=(1, 3))  # [rb, cb]


def mul_tiles(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``x`` [R, C] times the per-tile values ``s`` [ceil(R/br), ceil(C/bc)], contiguous.

    Tile by tile through the [rb, br, cb, bc] view, never ``s`` expanded to x's shape
    (Inductor's CPU code generator rejects that expand + reshape).
    """
    if block[0] == 1 and s.shape[1] == 1:
        return x.float() * s  # [R, 1] broadcasts over the row
    return _untile(_tiles(x.float(), block) * s[:, None, :, None], x.shape)


def tile_scales(stats: torch.Tensor, fmt: Fp8Format, power_of_2: bool = False) -> torch.Tensor:
    """[Note: scale] per tile: ``fmt.max / amax``; a zero or non-finite amax takes scale 1."""
    scale = scale_from_amax(stats, fmt.max)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def cast_tiles(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, block: tuple[int, int]) -> torch.Tensor:
    """FP8 bytes of the 2-D ``x`` with one ``scale`` per ``block`` tile ([Note: scale])."""
    x = x.detach()
    if block[0] == 1 and scale.shape[1] == 1:
        return cast_to_fp8(x, scale, fmt)  # [R, 1] scales broadcast over the rows
    # tile by tile: [rb, br, cb, bc] bytes times [rb, 1, cb, 1] scales
    return _untile(cast_to_fp8(_tiles(x, block), scale[:, None, :, None], fmt), x.shape)


def quantize_tiles(x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int],
                   power_of_2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling of the 2-D ``x`` per ``block`` tile: (FP8 bytes, fp32 ``scale_inv``)."""
    scale = tile_scales(tile_amax(x, block), fmt, power_of_2)
    return cast_tiles(x, scale, fmt, block), scale.reciprocal()


def weight_block(recipe: Recipe | str, shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
    """The tile one scale covers in a stored weight of ``shape`` under ``recipe`` (None: one
    scale for the whole tensor): rowwise (1, cols), blockwise (n, n)."""
    q = quantizer_for(recipe)
    if isinstance(q, TensorwiseQuantizer):
        return None
    if len(shape) != 2:
        raise ValueError(f"a {q.name} FP8 weight is 2-D [rows, cols], got shape {tuple(shape)}")
    return q.block("weight", shape)


class _TiledQuantizer:
    """Current scaling with one scale per tile; subclasses say the tile of each operand kind."""

    name = "tiled"
    ahead = False

    def __init__(self, power_of_2_scales: bool = False) -> None:
        self.power_of_2_scales = power_of_2_scales

    def block(self, kind: OperandKind, shape: torch.Size | tuple[int, int]) -> tuple[int, int]:
        raise NotImplementedError

    def local_stats(self, x: torch.Tensor, kind: OperandKind) -> torch.Tensor:
        _check_2d(x, f"{type(self).__name__}.local_stats")
        return tile_amax(x, self.block(_check_kind(kind), x.shape))

    def reduce(self, stats: torch.Tensor, group: Any = None) -> torch.Tensor:
        return _reduce_max(stats, group)

    def scales(self, stats: torch.Tensor, fmt: Fp8Format, prev: torch.Tensor | None = None) -> torch.Tensor:
        return tile_scales(stats, Fp8Format.parse(fmt), self.power_of_2_scales)  # no previous scale

    def cast_scaled(self, x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, kind: OperandKind,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        data = cast_tiles(x, scale, Fp8Format.parse(fmt), self.block(_check_kind(kind), x.shape))
        if out is None:
            return data
        return out.copy_(data.view(out.dtype))

    def cast(self, x: torch.Tensor, stats: torch.Tensor, fmt: Fp8Format, kind: OperandKind) -> Fp8Operand:
        fmt = Fp8Format.parse(fmt)
        scale = self.scales(stats, fmt)
        return Fp8Operand(self.cast_scaled(x, scale, fmt, kind), scale.reciprocal(),
                          self.block(_check_kind(kind), x.shape))

    def state(self, col: int) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of tensor ``col`` beside its scales: nothing (current scaling)."""
        return {}

    def load_state(self, col: int, sd: dict[str, torch.Tensor], what: str) -> None:
        """Nothing to load beside the scales (current scaling)."""

    def quantize(self, x: torch.Tensor, fmt: Fp8Format, kind: OperandKind, *, rows: bool = True,
                 cols: bool = False) -> tuple[Fp8Operand | None, Fp8Operand | None]:
        _check_2d(x, f"{type(self).__name__}.quantize")
        op_rows = self.cast(x, self.local_stats(x, kind), fmt, kind) if rows else None
        op_cols = None
        if cols:
            xt = x.detach().t().contiguous()  # [C, R]: contraction along x's rows
            op_cols = self.cast(xt, self.local_stats(xt, kind), fmt, kind)
        return op_rows, op_cols

    def gemm(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        _check_pair(a, b)
        if bias is not None and bias.shape != (b.data.shape[0],):
            raise ValueError(f"{type(self).__name__}.gemm: bias of shape {tuple(bias.shape)} for an output "
                             f"of {b.data.shape[0]} columns; pass a 1-D bias of length {b.data.shape[0]}")
        if self.gemm_path(a, b, out_dtype) == "scaled_mm":
            return self._scaled_mm(a, b, out_dtype, bias)
        return emulated_tiled_mm(a, b, out_dtype, bias)

    def gemm_path(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype) -> str:
        """``"scaled_mm"`` where ``torch._scaled_mm`` takes these scales (CUDA, see subclasses),
        else ``"emulated"`` (dequantize per tile, fp32 product): [Note: tiled GEMM paths]."""
        dev = a.data.device
        if dev.type != "cuda" or _gemm.resolved_gemm_path("cuda") == "emulated":
            return "emulated"
        why = self._scaled_mm_refusal(a, b, out_dtype, dev.index or 0)
        if why is None:
            return "scaled_mm"
        _gemm._report_once(f"{self.name}-emulated-{why}",
                           f"fp8shard: {self.name} FP8 GEMM emulated on CUDA ({why}): inputs rounded "
                           "through FP8 with their tile scales, product in fp32.")
        return "emulated"

    def _scaled_mm_refusal(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
                           device_index: int) -> str | None:
        return "no torch._scaled_mm layout for this recipe"

    def _scaled_mm(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
                   bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


# [Note: tiled GEMM paths]
#     Rowwise on CUDA sm90+ runs ``torch._scaled_mm`` with fp32 scales (M, 1) and (1, N) and a
#     bf16 output (dims multiples of 16); blockwise on sm90 runs it with the DeepSeek layouts
#     torch takes since 2.9 (1x128 scales [M, K/128] outer-dim-major, 128x128 scales
#     [N/128, K/128]; K a multiple of 128, bf16 output). Everything else -- CPU, other GPUs,
#     other dims or output dtypes -- is the emulation: each operand dequantized per tile to
#     fp32, one fp32 product (rowwise: the fp32 product of the FP8 values, then both scales,
#     which is the same sum the kernel takes). The emulation is the reference the GPU path is
#     tested against.
def emulated_tiled_mm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The emulated product ``a · bᵀ`` of two tile-scaled operands, fp32, one rounding."""
    if a.scale_inv.dim() == 2 and b.scale_inv.dim() == 2 and a.scale_inv.shape[1] == 1 \
            and b.scale_inv.shape[1] == 1 and a.block[0] == 1 and b.block[0] == 1:  # type: ignore[index]
        # One scale per row of each: they factor out of every dot product.
        out = torch.mm(a.data.float(), b.data.float().t()) * (a.scale_inv.float() * b.scale_inv.float().t())
    else:
        out = torch.mm(a.dequantize(), b.dequantize().t())
    if _gemm._bias_in_epilogue(bias, out_dtype) or (bias is not None and out_dtype == torch.float32):
        return (out + bias.float()).to(out_dtype)  # type: ignore[union-attr]
    if bias is not None:
        return out.to(out_dtype) + bias.to(out_dtype)
    return out.to(out_dtype)


def _sm(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


class RowwiseQuantizer(_TiledQuantizer):
    """One scale per row of every operand, along the contraction dim (torchao's rowwise)."""

    name = "rowwise"

    def block(self, kind: OperandKind, shape: torch.Size | tuple[int, int]) -> tuple[int, int]:
        return (1, max(int(shape[1]), 1))

    def _scaled_mm_refusal(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
                           device_index: int) -> str | None:
        if _sm(device_index) < (9, 0):
            return "rowwise torch._scaled_mm needs sm90+"
        if out_dtype != torch.bfloat16:
            return f"rowwise torch._scaled_mm outputs bf16, asked for {out_dtype}"
        m, k = a.data.shape
        n = b.data.shape[0]
        if m % 16 or k % 16 or n % 16:
            return "dims not multiples of 16"
        return None

    def _scaled_mm(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
                   bias: torch.Tensor | None) -> torch.Tensor:
        scale_a = a.scale_inv.float().reshape(-1, 1).contiguous()  # (M, 1)
        scale_b = b.scale_inv.float().reshape(1, -1).contiguous()  # (1, N)
        in_epilogue = bias is not None and bias.dtype == torch.bfloat16
        out = torch._scaled_mm(a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b,
                               bias=bias if in_epilogue else None, out_dtype=out_dtype)
        return out if bias is None or in_epilogue else out + bias.to(out_dtype)


class BlockwiseQuantizer(_TiledQuantizer):
    """DeepSeek-V3: activations and gradients 1 x ``block_size`` tiles along the contraction
    dim, weights ``block_size`` x ``block_size`` blocks."""

    name = "blockwise"

    def __init__(self, block_size: int = 128, power_of_2_scales: bool = False) -> None:
        super().__init__(power_of_2_scales)
        self.block_size = block_size

    def block(self, kind: OperandKind, shape: torch.Size | tuple[int, int]) -> tuple[int, int]:
        n = self.block_size
        return (n, n) if kind == "weight" else (1, n)

    def _scaled_mm_refusal(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
                           device_index: int) -> str | None:
        if self.block_size != 128 or a.block != (1, 128):
            return "torch._scaled_mm takes 1x128 tiles of the first operand only"
        if not hasattr(getattr(F, "ScalingType", None), "BlockWise1x128"):
            return f"torch {torch.__version__} has no blockwise torch._scaled_mm"
        if _sm(device_index)[0] != 9:
            return "blockwise torch._scaled_mm runs on sm90 only"
        if out_dtype != torch.bfloat16:
            return f"blockwise torch._scaled_mm outputs bf16, asked for {out_dtype}"
        m, k = a.data.shape
        n = b.data.shape[0]
        if k % 128 or m % 16 or n % 16:
            return "K not a multiple of 128 or M, N not multiples of 16"
        return None

    def _scaled_mm(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
                   bias: torch.Tensor | None) -> torch.Tensor:
        # 1x128 scales [M, K/128] outer-dim-major (stride (1, M)); the second operand's scales
        # are given for b [K, N] column-major: 128x128 -> [K/128, N/128] with stride (1, K/128),
        # 1x128 -> [K/128, N] row-major.
        scale_a = a.scale_inv.float().t().contiguous().t()
        if b.block == (128, 128):
            scale_b = b.scale_inv.float().contiguous().t()
        else:
            scale_b = b.scale_inv.float().t().contiguous()
        out = torch._scaled_mm(a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        return out if bias is None else out + bias.to(out_dtype)


def _check_kind(kind: str) -> OperandKind:
    if kind not in KINDS:
        raise ValueError(f"unknown operand kind {kind!r}; choose one of {', '.join(KINDS)} "
                         f"(gradients are 'activation')")
    return kind  # type: ignore[return-value]


def _check_pair(a: Fp8Operand, b: Fp8Operand) -> None:
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"gemm(a, b) = a · bᵀ needs a [M, K] and b [N, K] with the same K, got "
                         f"{tuple(a.data.shape)} and {tuple(b.data.shape)}")


# ------------------------------------------------------------------------------ recipes by name
RECIPE_NAMES = ("delayed", "current", "tensorwise", "rowwise", "blockwise")
_RECIPE_TYPES = (DelayedScaling, CurrentScaling, RowwiseScaling, BlockwiseScaling)


def parse_recipe(recipe: Recipe | str) -> Recipe:
    """A recipe object, or one made from its name: ``delayed`` (``DelayedScaling()``),
    ``current`` or ``tensorwise`` (``CurrentScaling()``), ``rowwise``, ``blockwise``."""
    if isinstance(recipe, _RECIPE_TYPES):
        return recipe
    if isinstance(recipe, str):
        name = recipe.lower()
        if name == "delayed":
            return DelayedScaling()
        if name in ("current", "tensorwise"):
            return CurrentScaling()
        if name == "rowwise":
            return RowwiseScaling()
        if name == "blockwise":
            return BlockwiseScaling()
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {', '.join(RECIPE_NAMES)}")
    raise TypeError(
        f"an FP8 recipe is a name ({', '.join(RECIPE_NAMES)}) or a fp8shard DelayedScaling, "
        f"CurrentScaling, RowwiseScaling or BlockwiseScaling, got "
        f"{type(recipe).__module__}.{type(recipe).__name__}; build one with e.g. fp8shard.RowwiseScaling()")


def quantizer_for(recipe: Recipe | str) -> TensorwiseQuantizer | RowwiseQuantizer | BlockwiseQuantizer:
    """The quantizer of a recipe (delayed scaling's per-layer state stays in ``fs.nn.Linear``)."""
    recipe = parse_recipe(recipe)
    if isinstance(recipe, RowwiseScaling):
        return RowwiseQuantizer(power_of_2_scales=recipe.power_of_2_scales)
    if isinstance(recipe, BlockwiseScaling):
        return BlockwiseQuantizer(recipe.block_size, power_of_2_scales=recipe.power_of_2_scales)
    return TensorwiseQuantizer()


def weight_quantizer(block: tuple[int, int]) -> RowwiseQuantizer | BlockwiseQuantizer:
    """The quantizer of a stored weight scaled per ``block`` tile (``Float8Tensor.block``)."""
    return RowwiseQuantizer() if block[0] == 1 else BlockwiseQuantizer(block[0])


def is_tiled(recipe: object) -> bool:
    """Whether ``recipe`` scales per tile (rowwise, blockwise) rather than per tensor."""
    return isinstance(recipe, (RowwiseScaling, BlockwiseScaling))


__all__ = [
    "AmaxHistory", "BlockwiseQuantizer", "DelayedTensorwiseQuantizer", "Fp8Operand", "OperandKind",
    "Quantizer", "RECIPE_NAMES", "RowwiseQuantizer", "TensorwiseQuantizer", "amax", "cast_tiles",
    "emulated_tiled_mm", "is_tiled", "mul_tiles", "parse_recipe", "quantize_tiles", "quantizer_for",
    "scale_from_amax", "tile_amax", "tile_scales", "weight_block", "weight_quantizer",
]

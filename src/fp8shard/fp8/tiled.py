"""Rowwise and blockwise: the quantizers with one scale per tile ([Note: quantizer]).

A tile is ``(br, bc)`` elements along the contraction dim: rowwise ``(1, C)`` for every operand
(torchao), blockwise ``(1, 128)`` for activations and gradients and ``(128, 128)`` for weights
(DeepSeek-V3). Their stats are tile amaxes, their scales the per-tile rule of [Note: scale]
(``tile_scales``: a zero or non-finite amax takes scale 1, no previous scale), their bytes the
encoding of ``fp8/quantizer.py`` applied tile by tile (``cast_tiles``), their GEMM
``torch._scaled_mm`` where it takes their scales, else an emulation ([Note: tiled GEMM paths]).
The protocol, the encoding and the per-tensor quantizers are in ``fp8/quantizer.py``, which
still exports these names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fp8shard.fp8 import gemm as _gemm
from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.quantizer import (
    Fp8Operand,
    OperandKind,
    TensorwiseQuantizer,
    _check_2d,
    _check_kind,
    _check_pair,
    _reduce_max,
    cast_to_fp8,
    quantizer_for,
    scale_from_amax,
)
from fp8shard.fp8.scaling import Recipe


# ------------------------------------------------------------------------------ tiles
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


def mul_tiles(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
              scale_first: bool = False) -> torch.Tensor:
    """fp32 ``x`` [R, C] times the per-tile values ``s`` [ceil(R/br), ceil(C/bc)], contiguous.

    Tile by tile through the [rb, br, cb, bc] view, never ``s`` expanded to x's shape
    (Inductor's CPU code generator rejects that expand + reshape). ``scale_first``: the same
    bits written as ``s * x`` ([Note: dequantize again]).
    """
    if block[0] == 1 and s.shape[1] == 1:
        return s * x.float() if scale_first else x.float() * s  # [R, 1] broadcasts over the row
    t, st = _tiles(x.float(), block), s[:, None, :, None]
    return _untile(st * t if scale_first else t * st, x.shape)


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

    def scales(self, stats: torch.Tensor, fmt: Fp8Format, prev: torch.Tensor | None = None,
               apply: torch.Tensor | None = None) -> torch.Tensor:
        # no state to keep (apply): the caller keeps its scales where the step is skipped
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
        a_data, b_t, scale_a, scale_b = blockwise_scaled_mm_operands(a, b)
        out = torch._scaled_mm(a_data, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        return out if bias is None else out + bias.to(out_dtype)


def blockwise_scaled_mm_operands(a: Fp8Operand, b: Fp8Operand
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, bᵀ, scale_a, scale_b)`` as blockwise ``torch._scaled_mm`` takes them for ``a · bᵀ``
    (``a`` 1x128 tiles; ``b`` 1x128 tiles or 128x128 blocks): [Note: blockwise scale layout].

    1x128 scales of ``a``: [M, K/128] outer-dim-major (stride (1, M)). ``b``'s scales are given
    for ``bᵀ`` [K, N] column-major: 128x128 -> [K/128, N/128] column-major, 1x128 ->
    [K/128, N] row-major. With 128x128 blocks and K/128 not a multiple of 4, K is zero-padded to
    the next multiple of 512 (bytes 0, scales 1: the product is unchanged)."""
    a_data, b_data = a.data, b.data
    scale_a, scale_b = a.scale_inv.float(), b.scale_inv.float()
    if b.block == (128, 128):
        k_blocks = a_data.shape[1] // 128
        pad = -(-k_blocks // 4) * 4 - k_blocks
        if pad:
            a_data, b_data = _pad_cols_fp8(a_data, pad * 128), _pad_cols_fp8(b_data, pad * 128)
            scale_a = torch.cat([scale_a, scale_a.new_ones(scale_a.shape[0], pad)], dim=1)
            scale_b = torch.cat([scale_b, scale_b.new_ones(scale_b.shape[0], pad)], dim=1)
        scale_b = blockwise_weight_scales(scale_b)
    else:
        scale_b = scale_b.t().contiguous()
    return a_data, b_data.t(), scale_a.t().contiguous().t(), scale_b


def _pad_cols_fp8(x: torch.Tensor, cols: int) -> torch.Tensor:
    """``x`` [R, C] FP8 with ``cols`` zero columns appended (through uint8: FP8 has no pad)."""
    return F.pad(x.view(torch.uint8), (0, cols)).view(x.dtype)


def blockwise_weight_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """The 128x128 scales of ``b`` [N, K] (grid [N/128, K/128]) as blockwise ``torch._scaled_mm``
    reads them for its second operand: [K/128, N/128], column-major (stride (1, K/128)). K/128
    must be a multiple of 4 ([Note: blockwise scale layout]; ``blockwise_scaled_mm_operands``
    pads K to make it so)."""
    k_blocks = scale_inv.shape[1]
    if k_blocks % 4:
        raise ValueError(f"blockwise_weight_scales: a grid of {k_blocks} blocks along K; blockwise "
                         "torch._scaled_mm reads the grid correctly only for a multiple of 4 -- pad K "
                         "to a multiple of 512 first (blockwise_scaled_mm_operands does)")
    return scale_inv.float().contiguous().t()


# [Note: blockwise scale layout]
#     The sm90 blockwise kernel steps through the 128x128 grid of its second operand with a
#     leading dimension rounded up to a multiple of 4 blocks. torch 2.11 checks for the packed
#     stride (1, K/128) and newer torch for the rounded one, so a grid with K/128 not a multiple
#     of 4 is either read wrongly (2.11: other blocks' scales and memory past the grid -- wrong
#     outputs, no error; found on an H100 for dx of a 512->256 layer, K = 256) or refused
#     ("Blockwise 1x16 scaling ... should be float4", as 2.11 reads a padded stride). Padding K
#     itself to a multiple of 512 satisfies both checks and the kernel: zero bytes with scale 1
#     add nothing. It costs a copy of both operands on such shapes (GPT-2 small's 768 -> 1024:
#     a third more GEMM work for the GEMMs that contract over 768).


# ------------------------------------------------------------------------------ stored weights
def weight_quantizer(block: tuple[int, int]) -> RowwiseQuantizer | BlockwiseQuantizer:
    """The quantizer of a stored weight scaled per ``block`` tile (``Float8Tensor.block``)."""
    return RowwiseQuantizer() if block[0] == 1 else BlockwiseQuantizer(block[0])


def weight_block(recipe: Recipe | str, shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
    """The tile one scale covers in a stored weight of ``shape`` under ``recipe`` (None: one
    scale for the whole tensor): rowwise (1, cols), blockwise (n, n)."""
    q = quantizer_for(recipe)
    if isinstance(q, TensorwiseQuantizer):
        return None
    if len(shape) != 2:
        raise ValueError(f"a {q.name} FP8 weight is 2-D [rows, cols], got shape {tuple(shape)}")
    return q.block("weight", shape)


__all__ = [
    "BlockwiseQuantizer", "RowwiseQuantizer", "blockwise_scaled_mm_operands",
    "blockwise_weight_scales", "cast_tiles", "emulated_tiled_mm",
    "mul_tiles", "quantize_tiles", "tile_amax", "tile_scales", "weight_block", "weight_quantizer",
]

"""Float8Tensor with a scale grid: rowwise [rows, 1] and blockwise 128x128 ([Note: Float8Tensor])."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import fp8shard as fs
from fp8shard.fp8 import Float8Tensor, Fp8Format
from fp8shard.fp8.quantizer import Fp8Operand, quantizer_for, tile_amax

SHAPE = (300, 200)
GRIDS = {"rowwise": ((1, 200), (300, 1)), "blockwise": ((128, 128), (3, 2))}


def _x() -> torch.Tensor:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    return x * torch.logspace(-3, 2, SHAPE[0])[:, None]  # rows of very different ranges


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_quantize_gives_the_quantizer_bytes_and_scale_grid(recipe):
    x = _x()
    t = Float8Tensor.quantize(x, Fp8Format.E4M3, recipe=recipe)
    block, grid = GRIDS[recipe]
    op, _ = quantizer_for(recipe).quantize(x, Fp8Format.E4M3, "weight")
    assert t.block == block and t.scale_inv.shape == grid and t.shape == SHAPE and t.dtype == x.dtype
    assert torch.equal(t.fp8_data.view(torch.uint8), op.data.view(torch.uint8))
    assert torch.equal(t.scale_inv, op.scale_inv)
    assert torch.equal(t.dequantize(), op.dequantize())
    # one scale per tile from the tile's amax: every tile's largest value lands on E4M3's max
    assert torch.equal(tile_amax(t.fp8_data.float(), block), torch.full(grid, 448.0))
    per_tensor = Float8Tensor.quantize(x, Fp8Format.E4M3)
    small = slice(0, 60)  # rows 10^5 below the largest: subnormal or zero under one scale
    err = (t.dequantize()[small] - x[small]).norm() / x[small].norm()
    assert err < 0.05 < (per_tensor.dequantize()[small] - x[small]).norm() / x[small].norm()


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_ops_keep_the_grid_or_dequantize(recipe):
    t = Float8Tensor.quantize(_x(), recipe=recipe)
    for kept in (t.detach(), t.clone(), copy.deepcopy(t), t.to(torch.bfloat16), t.view(SHAPE),
                 torch.nn.Parameter(t)):
        assert isinstance(kept, Float8Tensor) and kept.block == t.block, type(kept)
        assert torch.equal(kept.dequantize(torch.float32), t.dequantize())
    e = torch.empty_like(t)
    assert isinstance(e, Float8Tensor) and e.block == t.block and e.scale_inv.shape == t.scale_inv.shape
    for other in (t.t(), t.reshape(200, 300), t[:, :10], t[:10:2], t.narrow(0, 5, 7) if recipe == "blockwise"
                  else t.narrow(1, 0, 7), t.new_zeros(3, 3), t.view(-1).view(200, 300)):
        assert type(other) is torch.Tensor  # another scale grid: plain values
    assert torch.equal(t.t(), t.dequantize().t()) and torch.equal(t[:, :10], t.dequantize()[:, :10])
    dst = torch.empty_like(t)
    dst.copy_(t)  # the same grid: bytes and scales, bit for bit
    assert torch.equal(dst.uint8_view(), t.uint8_view()) and torch.equal(dst.scale_inv, t.scale_inv)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_in_place_writes_requantize_per_tile(recipe):
    x = _x()
    t = Float8Tensor.quantize(torch.zeros(SHAPE), recipe=recipe)
    scale_inv = t.scale_inv
    t.copy_(x)
    ref = Float8Tensor.quantize(x, recipe=recipe)
    assert t.scale_inv is scale_inv  # the same tensor, updated in place
    assert torch.equal(t.uint8_view(), ref.uint8_view()) and torch.equal(t.scale_inv, ref.scale_inv)
    t.mul_(2.0)
    ref2 = Float8Tensor.quantize(ref.dequantize() * 2.0, recipe=recipe)
    assert torch.equal(t.uint8_view(), ref2.uint8_view()) and torch.equal(t.scale_inv, ref2.scale_inv)
    with pytest.raises(ValueError, match="takes its scales from its tiles' amaxes; pass scale=None"):
        t.quantize_(x, scale=1.0)
    with pytest.raises(ValueError, match="pass scale=None"):
        Float8Tensor.quantize(x, scale=2.0, recipe=recipe)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_serialization_and_repr_carry_the_grid(recipe):
    t = Float8Tensor.quantize(_x(), recipe=recipe)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert back.block == t.block and torch.equal(back.uint8_view(), t.uint8_view())
    assert torch.equal(back.scale_inv, t.scale_inv)
    assert f"block={t.block}" in repr(t) and f"scale_inv shape={tuple(t.scale_inv.shape)}" in repr(t)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_linear_with_stored_tiled_weight_uses_its_bytes(recipe):
    """Forward: the stored bytes and scales as they are; dgrad: blockwise the transposed bytes and
    grid (exact), rowwise Wᵀ re-quantized per row of Wᵀ ([Note: tiled FP8 weights])."""
    with fs.fp8_model_init(recipe=recipe):
        layer = fs.nn.Linear(200, 300, bias=False)
    w = layer.weight
    assert w.block == GRIDS[recipe][0]
    x = torch.randn(16, 200, requires_grad=True)
    dy = torch.randn(16, 300)
    with fs.fp8_autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    q = quantizer_for(recipe)
    fmt = fs.RowwiseScaling().fp8_format if recipe == "rowwise" else fs.BlockwiseScaling().fp8_format
    x_op, _ = q.quantize(x.detach(), fmt.fwd, "activation")
    assert torch.equal(y, q.gemm(x_op, Fp8Operand(w.fp8_data, w.scale_inv, w.block), torch.float32))
    dy_op, _ = q.quantize(dy, fmt.bwd, "activation")
    if recipe == "blockwise":
        wt = Fp8Operand(w.fp8_data.t().contiguous(), w.scale_inv.t(), w.block)
    else:
        _, wt = q.quantize(w.dequantize(), fmt.fwd, "weight", rows=False, cols=True)
    assert torch.equal(x.grad, q.gemm(dy_op, wt, torch.float32))
    assert layer.weight.grad.shape == (300, 200) and not isinstance(layer.weight.grad, Float8Tensor)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_cuts_on_tile_rows_keep_fp8_with_their_grid_rows(recipe):
    """[Note: FP8 tiled slices]: rows cut on tile boundaries (any row rowwise, 128-row bands
    blockwise, or up to the last row) view their bytes and their rows of the grid; what FSDP2's
    sharding does with them (chunk, new_zeros, narrow + copy_, view(-1)) stays FP8, bit-exact."""
    t = Float8Tensor.quantize(_x(), recipe=recipe)
    br = t.block[0]
    head, tail = torch.split(t, [128, 172], dim=0)  # 128: a row for rowwise, a band for blockwise
    for part, rows in ((head, slice(0, 128)), (tail, slice(128, 300)), (t[128:], slice(128, 300)),
                       (t.narrow(0, 0, 128), slice(0, 128))):
        assert isinstance(part, Float8Tensor) and part.block == t.block
        assert part.scale_inv.data_ptr() == t.scale_inv[rows.start // br:].data_ptr()  # a view of the grid
        assert torch.equal(part.dequantize(), t.dequantize()[rows])
    if recipe == "blockwise":
        assert type(t[:100]) is torch.Tensor and type(torch.chunk(t, 2)[0]) is torch.Tensor  # 150 rows
    padded = t.new_zeros((172, 200))  # FSDP2's padded shard: zero bytes, a grid of ones
    assert isinstance(padded, Float8Tensor) and padded.block == t.block
    assert torch.equal(padded.scale_inv, torch.ones(-(-172 // br), t.scale_inv.shape[1]))
    padded.narrow(0, 0, 172).copy_(tail)  # bytes and grid rows, bit-exact
    assert torch.equal(padded.uint8_view(), tail.uint8_view())
    assert torch.equal(padded.scale_inv, tail.scale_inv)
    flat = padded.view(-1)  # what FSDP2 keeps of a shard: the same bytes, not a dequantized copy
    assert isinstance(flat, Float8Tensor) and flat.tile_shape == (172, 200)
    assert flat.fp8_data.data_ptr() == padded.fp8_data.data_ptr()
    assert torch.equal(flat.dequantize(), tail.dequantize().reshape(-1))
    assert isinstance(flat.view(172, 200), Float8Tensor)
    tail.copy_(torch.zeros(172, 200))  # a write into a tiled slice re-quantizes its own tiles only
    assert torch.equal(t.dequantize()[:128], head.dequantize()) and not t.dequantize()[128:].any()

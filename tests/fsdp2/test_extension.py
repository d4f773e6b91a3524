"""The Float8Tensor side of FSDP2, in one process: the ops sharding uses stay FP8, and the
all-gather hooks move the bytes as uint8 and rebuild the same FP8 tensor."""

from __future__ import annotations

import inspect

import pytest
import torch

from fp8shard.fp8 import Float8Tensor


class Mesh:
    """What fsdp_pre_all_gather reads of a device mesh: its size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def _weight(rows: int = 7, cols: int = 16) -> Float8Tensor:
    torch.manual_seed(0)
    return Float8Tensor.quantize(torch.randn(rows, cols))


def test_chunk_slice_new_zeros_stay_fp8():
    w = _weight()
    chunks = torch.chunk(w, 2, dim=0)  # what fully_shard does
    assert [type(c) for c in chunks] == [Float8Tensor, Float8Tensor]
    assert [c.shape[0] for c in chunks] == [4, 3]
    assert torch.equal(torch.cat([c.fp8_data.view(torch.uint8) for c in chunks]), w.uint8_view())
    assert all(c.scale_inv is w.scale_inv for c in chunks)  # views share the scale
    padded = chunks[1].new_zeros((4, 16))
    assert isinstance(padded, Float8Tensor) and padded.scale_inv is not w.scale_inv
    assert torch.equal(padded.scale_inv, w.scale_inv)  # same value, its own tensor
    padded.narrow(0, 0, 3).copy_(chunks[1])  # bytes and scale, bit-exact
    assert torch.equal(padded.uint8_view()[:3], chunks[1].uint8_view())
    assert isinstance(padded.view(-1), Float8Tensor)
    assert isinstance(w.new_empty(0), Float8Tensor)


def test_hook_signature_is_the_five_argument_form():
    # FSDP2 counts the bound method's parameters: 5 (torch >= 2.5) or 1 (torch 2.4).
    assert len(inspect.signature(_weight().fsdp_pre_all_gather).parameters) == 5


def test_pre_all_gather_pads_a_short_shard_and_post_rebuilds():
    w = _weight()
    full = w.new_zeros((8, 16))  # FSDP2's padded buffer of 2 x 4 rows
    full.narrow(0, 0, 7).copy_(w)  # bytes and scale
    short = full.narrow(0, 4, 3)  # rank 1's 3 real rows inside the padded buffer
    (inputs,), meta = short.fsdp_pre_all_gather(Mesh(2), torch.Size([7, 16]), None, None, None)
    assert inputs.dtype == torch.uint8 and tuple(inputs.shape) == (4, 16)
    # Gathered bytes of both ranks -> the unsharded Float8Tensor, no high-precision copy.
    (first,), _ = full.narrow(0, 0, 4).fsdp_pre_all_gather(Mesh(2), torch.Size([7, 16]), None, None, None)
    gathered = torch.cat([first.reshape(-1), inputs.reshape(-1)])
    unsharded, inner = w.fsdp_post_all_gather((gathered,), meta, torch.float32)
    assert inner[0].untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()  # FSDP2 frees it
    assert isinstance(unsharded, Float8Tensor)
    assert unsharded.fp8_data.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()
    assert torch.equal(unsharded.view(8, 16)[:7].dequantize(), w.dequantize())
    # A later gather refreshes the scale (a new tensor: backward may hold the old one).
    old = unsharded.scale_inv
    meta2 = (meta[0] * 2, meta[1])
    assert w.fsdp_post_all_gather((gathered,), meta2, torch.float32, out=unsharded) is None
    assert unsharded.scale_inv is not old and torch.equal(unsharded.scale_inv, old * 2)


def test_tiled_hooks_gather_bytes_and_grid_rows_and_rebuild_without_a_copy():
    """[Note: FSDP2 tiled weights]: a blockwise shard hands FSDP2 its bytes (uint8) and its rows
    of the grid (fp32); the gathered pair is the whole weight, wrapped as it is, the grid trimmed
    to the weight's bands; a later gather into ``out`` only drops the cached transpose."""
    torch.manual_seed(0)
    x = torch.randn(512, 256) * torch.logspace(-2, 2, 512)[:, None]
    w = Float8Tensor.quantize(x, recipe="blockwise")  # grid [4, 2]
    shards = torch.chunk(w, 2, dim=0)  # what fully_shard cuts: 256 rows, 2 bands each
    inputs = [s.fsdp_pre_all_gather(Mesh(2), w.shape, None, None, None) for s in shards]
    (data0, grid0), meta = inputs[0]
    assert data0.dtype == torch.uint8 and tuple(data0.shape) == (256, 256)
    assert grid0.dtype == torch.float32 and tuple(grid0.shape) == (2, 2)
    assert grid0.data_ptr() == w.scale_inv[:2].data_ptr()  # no copy of the grid rows either
    gathered = torch.cat([i[0][0] for i in inputs])  # what the all-gather hands back, rank-major
    grid = torch.cat([i[0][1] for i in inputs])
    unsharded, inner = w.fsdp_post_all_gather((gathered, grid), meta, torch.bfloat16)
    assert [t.data_ptr() for t in inner] == [gathered.data_ptr(), grid.data_ptr()]
    assert isinstance(unsharded, Float8Tensor) and unsharded.block == (128, 128)
    assert unsharded.fp8_data.data_ptr() == gathered.data_ptr()
    assert unsharded.scale_inv.data_ptr() == grid.data_ptr()
    assert torch.equal(unsharded.dequantize(torch.float32), w.dequantize())
    same = torch.as_strided(unsharded, (512, 256), (256, 1), 0)  # what FSDP2 makes the parameter
    assert isinstance(same, Float8Tensor) and same.block == (128, 128)
    before = unsharded.fp8_transpose()
    with torch.autograd._unsafe_preserve_version_counter(gathered):  # as FSDP2 copies a gather out
        gathered.zero_()  # the next gather lands in the same storage
    assert unsharded.fp8_transpose() is before  # stale until the hook says so
    assert w.fsdp_post_all_gather((gathered, grid), meta, torch.bfloat16, out=unsharded) is None
    assert unsharded.fp8_transpose() is not before and not unsharded.fp8_transpose().view(torch.uint8).any()


def test_rowwise_hooks_trim_the_grid_to_the_rows():
    torch.manual_seed(0)
    w = Float8Tensor.quantize(torch.randn(6, 16), recipe="rowwise")
    inputs = [s.fsdp_pre_all_gather(Mesh(3), w.shape, None, None, None) for s in torch.chunk(w, 3, dim=0)]
    assert [tuple(t.shape) for t in inputs[0][0]] == [(2, 16), (2, 1)]
    outputs = tuple(torch.cat([i[0][k] for i in inputs]) for k in range(2))
    unsharded, _ = w.fsdp_post_all_gather(outputs, inputs[0][1], torch.float32)
    assert unsharded.block == (1, 16) and torch.equal(unsharded.scale_inv, w.scale_inv)
    assert torch.equal(unsharded.uint8_view(), w.uint8_view())


def test_pre_all_gather_refuses_an_uneven_tiled_shard():
    """fully_shard_model refuses it before sharding; the hook too, with the same message, rather
    than FSDP2's padded-size assertion."""
    w = Float8Tensor.quantize(torch.randn(7, 16), recipe="rowwise")
    with pytest.raises(ValueError, match=r"cuts its 7 rows unevenly.*trainer\.strategy=flat"):
        torch.chunk(w, 2, dim=0)[0].fsdp_pre_all_gather(Mesh(2), w.shape, None, None, None)

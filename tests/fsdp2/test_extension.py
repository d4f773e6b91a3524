"""The Float8Tensor side of FSDP2, in one process: the ops sharding uses stay FP8, and the
all-gather hooks move the bytes as uint8 and rebuild the same FP8 tensor."""

from __future__ import annotations

import inspect

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

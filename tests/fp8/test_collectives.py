"""FP8 bytes travel through collectives as uint8 and rebuild identical tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fp8shard as fs


def _gather_fp8_shards(numel_per_rank: int) -> tuple[bytes, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    full = torch.Generator().manual_seed(1234)
    x = torch.randn(world * numel_per_rank, generator=full).to(device)
    scale = torch.tensor(3.0, device=device)  # one scale for the whole tensor: [Note: weight scaling]
    mine = fs.Float8Tensor.quantize(x[rank * numel_per_rank:(rank + 1) * numel_per_rank], scale=scale)
    out = torch.empty(world * numel_per_rank, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(out, mine.uint8_view())
    rebuilt = fs.Float8Tensor(out.view(torch.float8_e4m3fn), mine.scale_inv, mine.fp8_format, x.dtype)
    reference = fs.Float8Tensor.quantize(x, scale=scale)
    assert torch.equal(rebuilt.uint8_view(), reference.uint8_view())
    assert torch.equal(rebuilt.dequantize(), reference.dequantize())
    return bytes(out.cpu().numpy().tobytes()), float(rebuilt.scale_inv)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_fp8_bytes_rebuilds_identical_tensors(dist_pools, world_size):
    results = dist_pools(world_size).run(_gather_fp8_shards, 37)
    assert len(results) == world_size
    assert all(r == results[0] for r in results)  # identical bytes and scale on every rank
    assert len(results[0][0]) == 37 * world_size  # one byte per element on the wire


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")


def test_pool_reports_the_failing_rank(dist_pools):
    with pytest.raises(RuntimeError, match="rank 1"):
        dist_pools(2).run(_raise_on_rank_one)
    assert dist_pools(2).run(dist.get_rank) == [0, 1]  # the pool keeps serving

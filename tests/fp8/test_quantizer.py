"""The quantizer protocol ([Note: quantizer]): scale axes, casts, GEMMs and recipes by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fp8shard as fs
from fp8shard.fp8 import fused
from fp8shard.fp8.quantizer import (
    AmaxHistory,
    BlockwiseQuantizer,
    DelayedTensorwiseQuantizer,
    Fp8Operand,
    Quantizer,
    RowwiseQuantizer,
    TensorwiseQuantizer,
    emulated_tiled_mm,
    parse_recipe,
    quantizer_for,
    tile_amax,
)
from fp8shard.fp8.tiled import blockwise_scaled_mm_operands, blockwise_weight_scales
from fp8shard.testing import sqnr_db

E4M3, E5M2 = fs.Fp8Format.E4M3, fs.Fp8Format.E5M2
QUANTIZERS = {"tensorwise": TensorwiseQuantizer, "rowwise": RowwiseQuantizer, "blockwise": BlockwiseQuantizer}


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _gemm(q: Quantizer, x: torch.Tensor, w: torch.Tensor, fmt=E4M3) -> torch.Tensor:
    a, _ = q.quantize(x, fmt, "activation")
    b, _ = q.quantize(w, fmt, "weight")
    return q.gemm(a, b, torch.float32)


@pytest.mark.parametrize("shape", [(64, 256, 96), (50, 200, 70)], ids=["aligned", "ragged"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_gemm_sqnr_against_fp32(name, shape):
    m, k, n = shape
    x, w = _randn(m, k, seed=1), _randn(n, k, seed=2, scale=0.02)
    y = _gemm(QUANTIZERS[name](), x, w)
    sqnr = sqnr_db(x.double() @ w.double().t(), y)
    assert 25 <= sqnr < 40, f"{name}: {sqnr:.1f} dB (below 25: broken; 40+: not rounded through FP8)"


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_every_operand_of_the_three_gemms_sqnr(name):
    """dgrad and wgrad operands (the ``cols`` casts) are as good as the forward's."""
    q = QUANTIZERS[name]()
    x, w, dy = _randn(96, 256, seed=1), _randn(128, 256, seed=2, scale=0.02), _randn(96, 128, seed=3)
    x_op, xt_op = q.quantize(x, E4M3, "activation", cols=True)
    w_op, wt_op = q.quantize(w, E4M3, "weight", cols=True)
    dy_op, dyt_op = q.quantize(dy, E5M2, "activation", cols=True)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    assert sqnr_db(x64 @ w64.t(), q.gemm(x_op, w_op, torch.float32)) >= 25
    assert sqnr_db(dy64 @ w64, q.gemm(dy_op, wt_op, torch.float32)) >= 20  # E5M2 gradients
    assert sqnr_db(dy64.t() @ x64, q.gemm(dyt_op, xt_op, torch.float32)) >= 20


def test_outlier_channels_rowwise_and_blockwise_beat_per_tensor_by_3db():
    """A few activation channels 100x the rest: finer scales keep the other values' precision.

    The weight is +-0.02: exact in FP8 under every recipe, so the GEMM's error is the
    activation's alone.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=gen)
    x[:, torch.randperm(512, generator=gen)[:4]] *= 100.0
    w = torch.sign(torch.randn(256, 512, generator=gen)) * 0.02
    ref = x.double() @ w.double().t()
    sqnr = {name: sqnr_db(ref, _gemm(cls(), x, w)) for name, cls in QUANTIZERS.items()}
    assert sqnr["rowwise"] >= sqnr["tensorwise"] + 3, sqnr
    assert sqnr["blockwise"] >= sqnr["tensorwise"] + 3, sqnr


def test_rowwise_scales_run_along_the_contraction_dim_of_each_operand():
    x = _randn(40, 96) * torch.linspace(0.01, 10, 40)[:, None]  # rows of very different ranges
    op, op_t = RowwiseQuantizer().quantize(x, E4M3, "activation", cols=True)
    assert op.scale_inv.shape == (40, 1) and op.block == (1, 96)
    assert op_t.data.shape == (96, 40) and op_t.scale_inv.shape == (96, 1)
    # every row of each operand uses the whole E4M3 range: its max |byte| is 448
    assert torch.all(op.data.float().abs().amax(dim=1) == E4M3.max)
    assert torch.all(op_t.data.float().abs().amax(dim=1) == E4M3.max)
    torch.testing.assert_close(op.scale_inv[:, 0], x.abs().amax(dim=1) / E4M3.max)
    torch.testing.assert_close(op_t.scale_inv[:, 0], x.abs().amax(dim=0) / E4M3.max)


def test_blockwise_tiles_are_1x128_for_activations_and_128x128_for_weights():
    q = BlockwiseQuantizer()
    x = _randn(130, 300)
    act, _ = q.quantize(x, E4M3, "activation")
    wgt, _ = q.quantize(x, E4M3, "weight")
    assert act.block == (1, 128) and act.scale_inv.shape == (130, 3)
    assert wgt.block == (128, 128) and wgt.scale_inv.shape == (2, 3)
    torch.testing.assert_close(act.scale_inv, tile_amax(x, (1, 128)) / E4M3.max)
    torch.testing.assert_close(wgt.scale_inv, tile_amax(x, (128, 128)) / E4M3.max)
    # a tile's amax is the max of exactly its elements, partial edge tiles included
    assert tile_amax(x, (128, 128))[1, 2] == x[128:, 256:].abs().max()
    assert tile_amax(x, (1, 128))[5, 1] == x[5, 128:256].abs().max()
    torch.testing.assert_close(act.dequantize(), x, rtol=0.07, atol=0)


def test_blockwise_weight_cast_for_dgrad_is_the_transpose_of_the_forward_cast():
    w_op, wt_op = BlockwiseQuantizer().quantize(_randn(256, 384), E4M3, "weight", cols=True)
    assert torch.equal(wt_op.data.view(torch.uint8), w_op.data.t().contiguous().view(torch.uint8))
    assert torch.equal(wt_op.scale_inv, w_op.scale_inv.t())


def test_tensorwise_quantizer_is_todays_fused_cast():
    x = _randn(64, 96, scale=3.0)
    op, op_t = TensorwiseQuantizer().quantize(x, E4M3, "activation", cols=True)
    ref = fused.quantize_current(x, E4M3, transpose=True)
    assert torch.equal(op.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(op_t.data.view(torch.uint8), ref.data_t.view(torch.uint8))
    assert op.scale_inv.dim() == 0 and torch.equal(op.scale_inv, ref.scale_inv)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_stats_reduce_cast_is_quantize(name):
    """The protocol's three steps give what ``quantize`` (current scaling) gives."""
    q = QUANTIZERS[name]()
    x = _randn(64, 256, scale=2.0)
    for kind in ("activation", "weight"):
        stats = q.reduce(q.local_stats(x, kind), group=None)
        op = q.cast(x, stats, E4M3, kind)
        ref, _ = q.quantize(x, E4M3, kind)
        assert torch.equal(op.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(op.scale_inv, ref.scale_inv) and op.block == ref.block


def test_global_stats_give_every_shard_the_same_scales():
    """Per-tensor stats MAX-reduced over the shards of a tensor (what ``reduce`` does over a
    group) cast each shard as the whole tensor is cast: the shards' bytes form the whole's.
    Blockwise shards cut at block edges need no reduction: their stats are the whole's tiles."""
    w = _randn(256, 256)
    per_tensor = TensorwiseQuantizer()
    shards = w.split(64)
    stats = torch.stack([per_tensor.local_stats(p, "weight") for p in shards]).amax()  # the MAX reduce
    got = torch.cat([per_tensor.cast(p, stats, E4M3, "weight").data for p in shards])
    whole = per_tensor.cast(w, per_tensor.local_stats(w, "weight"), E4M3, "weight")
    assert torch.equal(got.view(torch.uint8), whole.data.view(torch.uint8))
    q = BlockwiseQuantizer()
    tiles = torch.cat([q.local_stats(p, "weight") for p in w.split(128)])
    assert torch.equal(tiles, q.local_stats(w, "weight"))


def _rowwise_cast_of_a_k_sharded_tensor() -> tuple[bytes, bytes]:
    """Each rank holds a column slice (a K shard) of x: local row amaxes, MAX over the group,
    then each rank casts its slice with the global scales."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _randn(24, 64 * world, seed=5) * torch.logspace(-1, 1, 64 * world)  # columns differ in range
    mine = x[:, rank * 64:(rank + 1) * 64]
    q = RowwiseQuantizer()
    stats = q.reduce(q.local_stats(mine, "activation"), group=dist.group.WORLD)
    op = q.cast(mine, stats, E4M3, "activation")
    gathered = [torch.empty_like(op.data.view(torch.uint8)) for _ in range(world)]
    dist.all_gather(gathered, op.data.view(torch.uint8).contiguous())
    whole, _ = q.quantize(x, E4M3, "activation")
    return (torch.cat(gathered, dim=1).numpy().tobytes(), whole.data.view(torch.uint8).numpy().tobytes())


def test_reduce_over_a_group_makes_shards_cast_as_the_whole_tensor(dist_pools):
    results = dist_pools(2).run(_rowwise_cast_of_a_k_sharded_tensor)
    for got, whole in results:
        assert got == whole


def test_zero_tiles_keep_scale_one_and_nan_stays_in_its_tile():
    x = _randn(4, 256)
    x[1] = 0.0
    x[2, 5] = float("nan")
    op, _ = BlockwiseQuantizer().quantize(x, E4M3, "activation")
    assert torch.all(op.scale_inv[1] == 1.0) and torch.all(op.data[1].float() == 0)
    assert op.scale_inv[2, 0] == 1.0  # non-finite amax: scale 1 ([Note: scale])
    assert torch.isnan(op.data[2, 5].float()) and not torch.isnan(op.data[2, 128:].float()).any()
    assert op.scale_inv[2, 1] != 1.0  # the other tile of that row keeps its own scale


def test_power_of_2_scales_are_powers_of_two():
    op, _ = RowwiseQuantizer(power_of_2_scales=True).quantize(_randn(32, 64, scale=3.0), E4M3, "activation")
    log2 = torch.log2(op.scale_inv)
    assert torch.equal(log2, log2.round())
    assert torch.all(op.data.float().abs().amax(dim=1) <= E4M3.max)


def test_rowwise_emulation_is_the_dequantized_product():
    q = RowwiseQuantizer()
    a, _ = q.quantize(_randn(32, 64, seed=1), E4M3, "activation")
    b, _ = q.quantize(_randn(48, 64, seed=2), E4M3, "weight")
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    torch.testing.assert_close(emulated_tiled_mm(a, b, torch.float32).double(), ref, rtol=1e-5, atol=1e-5)


def test_gemm_adds_the_bias_and_rounds_once():
    q = BlockwiseQuantizer()
    a, _ = q.quantize(_randn(16, 256, seed=1), E4M3, "activation")
    b, _ = q.quantize(_randn(32, 256, seed=2), E4M3, "weight")
    bias = _randn(32, seed=3)
    ref = a.dequantize() @ b.dequantize().t() + bias
    torch.testing.assert_close(q.gemm(a, b, torch.float32, bias), ref)
    y16 = q.gemm(a, b, torch.bfloat16, bias.bfloat16())
    assert torch.equal(y16, (a.dequantize() @ b.dequantize().t() + bias.bfloat16().float()).bfloat16())


def test_quantizers_satisfy_the_protocol():
    for cls in QUANTIZERS.values():
        assert isinstance(cls(), Quantizer)


@pytest.mark.parametrize(("name", "kind"), [("delayed", fs.DelayedScaling), ("current", fs.CurrentScaling),
                                            ("tensorwise", fs.CurrentScaling), ("rowwise", fs.RowwiseScaling),
                                            ("blockwise", fs.BlockwiseScaling)])
def test_recipes_by_name(name, kind):
    assert isinstance(parse_recipe(name), kind)
    expected = {"rowwise": RowwiseQuantizer, "blockwise": BlockwiseQuantizer}.get(name, TensorwiseQuantizer)
    assert type(quantizer_for(name)) is expected


def test_bad_input_errors_name_the_problem_and_the_fix():
    with pytest.raises(ValueError, match=r"unknown FP8 recipe 'rowise'; choose one of delayed, current, "
                                         r"tensorwise, rowwise, blockwise"):
        parse_recipe("rowise")
    with pytest.raises(TypeError, match=r"fp8shard.RowwiseScaling\(\)"):
        parse_recipe(3)
    q = RowwiseQuantizer()
    with pytest.raises(ValueError, match=r"unknown operand kind 'gradient'.*gradients are 'activation'"):
        q.quantize(_randn(4, 8), E4M3, "gradient")
    with pytest.raises(ValueError, match=r"flatten leading dims first"):
        q.quantize(_randn(2, 4, 8), E4M3, "activation")
    a, _ = q.quantize(_randn(4, 8), E4M3, "activation")
    b, _ = q.quantize(_randn(4, 16), E4M3, "weight")
    with pytest.raises(ValueError, match=r"same K, got \(4, 8\) and \(4, 16\)"):
        q.gemm(a, b, torch.float32)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        fs.BlockwiseScaling(block_size=0)


def test_operand_dequantize_covers_partial_tiles():
    x = _randn(3, 130)
    op = Fp8Operand(*BlockwiseQuantizer().quantize(x, E4M3, "activation")[0][:2], (1, 128))
    assert op.dequantize().shape == (3, 130)
    torch.testing.assert_close(op.dequantize(), x, rtol=0.07, atol=0)


# ------------------------------------------------------------------------------ GPU (sm90)
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 512, 384), (64, 128, 32)])
def test_rowwise_scaled_mm_on_sm90_matches_the_emulation(shape):
    if not _sm90():
        pytest.skip("rowwise torch._scaled_mm needs sm90+")
    m, k, n = shape
    q = RowwiseQuantizer()
    x, w = _randn(m, k, seed=1).cuda(), _randn(n, k, seed=2, scale=0.02).cuda()
    for fa, fb in ((E4M3, E4M3), (E5M2, E4M3)):
        a, _ = q.quantize(x, fa, "activation")
        b, _ = q.quantize(w, fb, "weight")
        assert q.gemm_path(a, b, torch.bfloat16) == "scaled_mm"
        y = q.gemm(a, b, torch.bfloat16)
        ref = emulated_tiled_mm(a, b, torch.float32)
        assert y.dtype == torch.bfloat16
        assert sqnr_db(ref, y) >= 45, f"{fa}x{fb}: {sqnr_db(ref, y):.1f} dB"  # bf16 rounding only


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 512, 384), (128, 256, 128), (128, 256, 512), (64, 384, 256)])
def test_blockwise_gemm_on_cuda_matches_the_emulation(shape):
    """sm90: torch._scaled_mm with DeepSeek scales where this torch has them, else emulated.
    K of 256 and 384 with several column blocks: K is padded to 512 there
    (``blockwise_scaled_mm_operands``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m, k, n = shape
    q = BlockwiseQuantizer()
    x, w = _randn(m, k, seed=1).cuda(), _randn(n, k, seed=2, scale=0.02).cuda()
    a, at = q.quantize(x, E4M3, "activation", cols=True)
    b, _ = q.quantize(w, E4M3, "weight")
    dy_t, _ = q.quantize(_randn(n, m, seed=3).cuda(), E4M3, "activation")  # wgrad: 1x128 x 1x128
    for lhs, rhs in ((a, b), (dy_t, at)):
        y = q.gemm(lhs, rhs, torch.bfloat16)
        ref = emulated_tiled_mm(lhs, rhs, torch.float32)
        assert sqnr_db(ref, y) >= 45, f"{q.gemm_path(lhs, rhs, torch.bfloat16)}: {sqnr_db(ref, y):.1f} dB"


def test_blockwise_scaled_mm_operands_are_what_both_torch_layout_checks_take_and_keep_the_product():
    """CPU twin of the GPU test above: the operands handed to blockwise torch._scaled_mm. With
    128x128 weight blocks, K/128 is made a multiple of 4 (zero bytes, unit scales), so the grid's
    packed stride (what torch 2.11 checks) equals its rounded one (what the kernel reads, and
    later torch checks); read as the kernel reads them, the operands give the same product."""
    q = BlockwiseQuantizer()
    m, n = 32, 384
    for k_blocks in range(1, 7):
        k = 128 * k_blocks
        a, _ = q.quantize(_randn(m, k, seed=k_blocks), E4M3, "activation")
        b, _ = q.quantize(_randn(n, k, seed=10 + k_blocks, scale=0.02), E4M3, "weight")
        a_data, b_t, sa, sb = blockwise_scaled_mm_operands(a, b)
        kp = -(-k_blocks // 4) * 4  # padded block count
        assert a_data.shape == (m, 128 * kp) and b_t.shape == (128 * kp, n) and b_t.stride() == (1, 128 * kp)
        assert sa.shape == (m, kp) and sa.stride() == (1, m)
        assert sb.shape == (kp, n // 128) and sb.stride() == (1, kp) and sb.dtype == torch.float32
        # The kernel's reading: column block j of the grid at j * round_up(K/128, 4).
        grid = torch.as_strided(sb, (n // 128, kp), (-(-kp // 4) * 4, 1))
        w = (b_t.t().float().reshape(n // 128, 128, kp, 128) * grid[:, None, :, None]).reshape(n, 128 * kp)
        x = (a_data.float().reshape(m, kp, 128) * sa[:, :, None]).reshape(m, 128 * kp)
        ref = emulated_tiled_mm(a, b, torch.float32)
        assert sqnr_db(ref, x @ w.t()) > 100, k_blocks
        if k_blocks % 4:
            with pytest.raises(ValueError, match="multiple of 4"):
                blockwise_weight_scales(b.scale_inv)
    # 1x128 second operand (the weight gradient): no padding, scales [K/128, N] row-major.
    a, _ = q.quantize(_randn(m, 256, seed=1), E4M3, "activation")
    b, _ = q.quantize(_randn(n, 256, seed=2), E4M3, "activation")
    a_data, b_t, sa, sb = blockwise_scaled_mm_operands(a, b)
    assert a_data.shape == (m, 256) and sb.shape == (2, n) and sb.stride() == (n, 1)


# ------------------------------------------------------------------------------ scales, casts
def test_scale_rule_lives_here_and_keeps_its_old_names():
    from fp8shard.fp8 import quantizer, scaling

    for name in ("scale_from_amax", "amax", "AmaxHistory"):
        assert getattr(scaling, name) is getattr(quantizer, name) is getattr(fs.fp8, name)


def test_tensorwise_scales_keep_the_previous_scale_where_the_amax_is_bad():
    stats = torch.tensor([0.0, float("nan"), float("inf"), 2.0, 1e-45])
    prev = torch.tensor([3.0, 5.0, 7.0, 11.0, 13.0])
    got = TensorwiseQuantizer().scales(stats, E4M3, prev)
    assert torch.equal(got, torch.tensor([3.0, 5.0, 7.0, E4M3.max / 2.0, 13.0]))
    assert torch.equal(TensorwiseQuantizer().scales(torch.tensor(0.0), E4M3), torch.tensor(1.0))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_tensorwise_scales_are_the_amax_history_bit_for_bit(algo):
    """The optimizer's delayed weight scaling: record the reduced stats, scales for the next
    cast from the window, exactly as an ``AmaxHistory`` over the same slots."""
    recipe = fs.DelayedScaling(amax_history_len=4, amax_compute_algo=algo, margin=1)
    q = DelayedTensorwiseQuantizer(3, recipe, E5M2)
    ref = AmaxHistory(3, recipe, torch.full((3,), E5M2.max))
    prev = torch.tensor([2.0, 3.0, 4.0])
    ref.scale = prev.clone()
    g = torch.Generator().manual_seed(0)
    for t in range(9):
        stats = torch.rand(3, generator=g) * 10 ** (t % 4)
        stats[t % 3] = [0.0, float("nan"), float("inf")][t % 3]
        prev = q.scales(stats, E5M2, prev)
        for s in range(3):
            ref.record(s, stats[s])
        assert torch.equal(prev, ref.update())
    torch.testing.assert_close(q.state(1)["amax_history"], ref.history[:, 1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_cast_is_scales_then_cast_scaled(name):
    q = QUANTIZERS[name]()
    x = _randn(130, 256, seed=3)
    stats = q.local_stats(x, "weight")
    op = q.cast(x, stats, E4M3, "weight")
    scales = q.scales(stats, E4M3)
    assert torch.equal(op.scale_inv, scales.reciprocal())
    out = torch.empty(x.shape, dtype=torch.uint8)
    q.cast_scaled(x, scales, E4M3, "weight", out=out)
    assert torch.equal(out, op.data.view(torch.uint8))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_level_amax_is_the_whole_tensor_max_nan_and_inf_included(compiled):
    """[Note: two-level amax]: rows first, then their maxima; the value of abs().max() exactly."""
    from fp8shard.fp8.quantizer import amax

    def whole(t):
        return t.abs().max().float()

    f = torch.compile(amax, backend="aot_eager", fullgraph=True) if compiled else amax
    cases = [_randn(48, 80, seed=1).bfloat16(), _randn(3, 16, 40, seed=2), _randn(64, 1, seed=3),
             _randn(7, seed=4), _randn(5, 9, seed=5) * 1e-30]
    for t in cases:
        assert torch.equal(f(t), whole(t)), tuple(t.shape)
    t = _randn(32, 64, seed=6)
    t[5, 7] = float("inf")
    assert f(t).item() == float("inf")
    t[30, 2] = float("nan")
    assert f(t).isnan().item()
    assert f(torch.empty(0, 8)).item() == 0.0

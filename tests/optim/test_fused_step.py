"""The fused optimizer step ([Note: fused step]): tile tables, the reference path, the Triton kernels.

CPU: the tile table's invariants on many layouts; the reference ops against what the optimizer
computes today (``adam_`` over runs, ``local_amax``, ``cast_region``), bit for bit; and the whole
fused orchestration (``step_kernel="fused"``, PyTorch reference ops) against the default path,
bit for bit, in one process and on gloo ranks.

GPU (``-m gpu``, the H200): the Triton kernels against the reference on fresh random data, for
layouts with parameters straddling buckets and shards and sizes that are not multiples of the
tile: FP8 bytes bit-exact with ``cast_to_fp8`` of the Triton master, amax bit-exact, nothing
outside the tiles written, master / exp_avg / exp_avg_sq within ``ULPS`` ulps (below) of the
CUDA foreach reference. ``DistributedFusedAdam`` with and without the Triton kernels:
``test_fused_step_optimizer.py``. The same kernel checks run on the CPU under Triton's
interpreter in ``test_fused_step_interpreted.py``.
"""

from __future__ import annotations

import bisect
import copy
import importlib
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8shard
from fp8shard.fp8 import Float8Tensor, Fp8Format, cast_to_fp8
from fp8shard.optim import DistributedFusedAdam
from fp8shard.optim import fused_step as fs
from fp8shard.optim.buffers import RegionBuffers
from fp8shard.optim.fp8_weights import Fp8WeightScaler
from fp8shard.optim.fused_step import adam_
from fp8shard.optim.layout import ParamSpec, build_layout
from tests.optim.dist_cases import TINY_BUCKET_MB, TinyMixed, batch, param_groups

ULPS = 4
"""Tolerance of the Triton master / exp_avg / exp_avg_sq against the foreach reference
(``adam_(fused=False)``): ``|triton - ref| <= ULPS * ulp(scale)`` elementwise, ``scale`` the largest
magnitude among the result and the operands that meet in one rounding (old value and gradient
for exp_avg; old value and update for master), so a differently contracted multiply-add in a
cancellation stays inside it. 16-bit states: one unit of the 16-bit format at that scale.
The kernel evaluates the CUDA foreach kernels' ops (same fma placement), so against the CUDA
reference it is expected to be 0-1 ulp; against the CPU reference (x*y/z where CUDA has
x*(y/z), no fma in addcmul) the Triton interpreter measured up to 3.5."""


# ============================================================================ helpers
def _region(world: int, rank: int, sizes: list[int], dtype: torch.dtype, *, bucket: int, align: int,
            grad_dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu", seed: int = 0) -> RegionBuffers:
    """A region with random master, states and gradients in the pieces, sentinels elsewhere."""
    (lay,) = build_layout([ParamSpec(i, n, dtype) for i, n in enumerate(sizes)], world, bucket, align)
    rb = RegionBuffers(lay, rank, torch.device(device), grad_dtype, state_dtype)
    gen = torch.Generator().manual_seed(seed)
    master = torch.full((lay.shard_numel,), 777.0)  # padding sentinels: no kernel may write them
    m = torch.full((lay.shard_numel,), -555.0)
    v = torch.full((lay.shard_numel,), 333.0)
    for pc in rb.pieces:
        s = slice(pc.local_offset, pc.local_offset + pc.numel)
        master[s] = torch.randn(pc.numel, generator=gen) * 0.05
        m[s] = torch.randn(pc.numel, generator=gen) * 1e-3
        v[s] = torch.rand(pc.numel, generator=gen) * 1e-5
    rb.master.copy_(master)
    rb.exp_avg.copy_(m)
    rb.exp_avg_sq.copy_(v)
    rb.grad_buffer.copy_(torch.randn(lay.numel, generator=gen) * 3e-3)
    rb.param_buffer.view(torch.uint8).fill_(0xA5)
    return rb


def _clone(rb: RegionBuffers) -> RegionBuffers:
    c = copy.copy(rb)
    for k in ("param_buffer", "grad_buffer", "master", "exp_avg", "exp_avg_sq"):
        setattr(c, k, getattr(rb, k).clone())
    return c


def _tables(rb: RegionBuffers, n_params: int, block: int) -> fs.TileTable:
    group_of = {i: i % 2 for i in range(n_params)}
    slot_of = {i: i for i in range(n_params)} if rb.is_fp8 else {}
    return fs.build_tile_table(rb.pieces, group_of, slot_of, block, rb.master.device)


SCALARS = [fs.AdamScalars(3, 1e-2, 0.9, 0.999, 1e-8, 0.1, True),
           fs.AdamScalars(3, 3e-3, 0.3, 0.95, 1e-6, 0.0, True)]  # beta1 0.3: lerp's other formula


def _scalars(adam_w: bool) -> list[fs.AdamScalars]:
    return [fs.AdamScalars(s.step, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, adam_w) for s in SCALARS]


# ============================================================================ tile table (CPU)
def _check_table(lay, rank: int, table: fs.TileTable, group_of, slot_of, block: int) -> None:
    pieces = lay.pieces(rank)
    lo, po = table.local_start.tolist(), table.param_start.tolist()
    n, sl, pi = table.numel.tolist(), table.slot.tolist(), table.param_index.tolist()
    assert table.num_tiles == sum(-(-pc.numel // block) for pc in pieces)
    cover = torch.zeros(lay.shard_numel, dtype=torch.int32)
    by_local = {pc.local_offset: pc for pc in pieces}
    starts = sorted(by_local)
    for t in range(table.num_tiles):
        assert 1 <= n[t] <= block
        # the piece holding the tile's first element must hold its last one too
        pc = by_local[starts[bisect.bisect_right(starts, lo[t]) - 1]]
        assert pc.local_offset <= lo[t] and lo[t] + n[t] <= pc.local_offset + pc.numel, "tile crosses a piece"
        assert po[t] - pc.region_offset == lo[t] - pc.local_offset  # same elements in both buffers
        assert (lo[t] - pc.local_offset) % block == 0
        assert pi[t] == pc.param_index and sl[t] == slot_of.get(pc.param_index, -1)
        assert lo[t] % table.align == 0 and po[t] % table.align == 0
        cover[lo[t]:lo[t] + n[t]] += 1
    want = torch.zeros(lay.shard_numel, dtype=torch.int32)
    for pc in pieces:
        want[pc.local_offset:pc.local_offset + pc.numel] = 1
    assert torch.equal(cover, want), "tiles must cover every piece element exactly once, nothing else"
    # sorted by (group, local offset); group ranges partition the tiles
    keys = [(group_of[i], a) for i, a in zip(pi, lo, strict=True)]
    assert keys == sorted(keys)
    gr = table.group_ranges
    assert [r[1] for r in gr] == [0, *[r[2] for r in gr]][:len(gr)]
    assert (table.group_ranges[-1][2] if table.group_ranges else 0) == table.num_tiles
    for g, t0, t1 in table.group_ranges:
        assert all(group_of[i] == g for i in pi[t0:t1])
    assert table.align & (table.align - 1) == 0 and 1 <= table.align <= 16
    # merged back, the tiles are the pieces (a parameter's pieces contiguous in both buffers, as
    # at world size 1 across buckets, merge into one span)
    runs: list[list[int]] = []
    for pc in sorted(pieces, key=lambda pc: (group_of[pc.param_index], pc.local_offset)):
        r = runs[-1] if runs else None
        if (r and r[4] == pc.param_index and r[0] + r[2] == pc.local_offset
                and r[1] + r[2] == pc.region_offset):
            r[2] += pc.numel
        else:
            runs.append([pc.local_offset, pc.region_offset, pc.numel, slot_of.get(pc.param_index, -1),
                         pc.param_index])
    assert table.spans() == [tuple(r[:4]) for r in runs]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("alignment", [1, 16])
def test_tile_table_invariants(world_size, alignment):
    rng = random.Random(world_size * 100 + alignment)
    for _ in range(6):
        n_params = rng.randint(1, 12)
        sizes = [rng.choice([1, 7, 16, 91, 128, 300, 1000, 4097]) for _ in range(n_params)]
        bucket = rng.choice([64, 256, 1000, 5000])
        block = rng.choice([16, 64, 256, 2048])
        specs = [ParamSpec(i, n, "k") for i, n in enumerate(sizes)]
        (lay,) = build_layout(specs, world_size, bucket, alignment)
        group_of = {i: rng.randint(0, 2) for i in range(n_params)}
        slot_of = {i: n_params - 1 - i for i in range(n_params) if i % 3}
        for rank in range(world_size):
            table = fs.build_tile_table(lay.pieces(rank), group_of, slot_of, block)
            _check_table(lay, rank, table, group_of, slot_of, block)


def test_tiles_of_parameters_straddling_buckets_and_shards():
    # one 1000-element parameter over buckets of 96 at world size 3: 32-element shards
    (lay,) = build_layout([ParamSpec(0, 1000, "k"), ParamSpec(1, 5, "k")], 3, 96, 1)
    for rank in range(3):
        pieces = lay.pieces(rank)
        assert len({pc.bucket for pc in pieces if pc.param_index == 0}) > 5
        table = fs.build_tile_table(pieces, {0: 0, 1: 0}, {0: 0, 1: 1}, block=16)
        _check_table(lay, rank, table, {0: 0, 1: 0}, {0: 0, 1: 1}, 16)
        assert all(n <= 16 for n in table.numel.tolist())


def test_empty_shards_make_empty_tables():
    # 3 elements at world size 5 with alignment 16: ranks 1..4 own only padding
    (lay,) = build_layout([ParamSpec(0, 3, "k")], 5, 1000, 16)
    assert lay.pieces(0) and not lay.pieces(4)
    table = fs.build_tile_table(lay.pieces(4), {0: 0}, {0: 0})
    assert table.num_tiles == 0 and table.group_ranges == () and table.spans() == []
    amax = fs.slot_amax([table], [torch.zeros(0)], 1, torch.device("cpu"))
    assert torch.equal(amax, torch.zeros(1))
    rb = _region(5, 4, [3], torch.float8_e4m3fn, bucket=1000, align=16)
    before = _clone(rb)
    fs.adam_tiles_(rb, fs.build_tile_table(rb.pieces, {0: 0}, {0: 0}), SCALARS, out_mode=fs.OUT_AMAX,
                   partial_amax=torch.zeros(0))
    assert torch.equal(rb.master, before.master) and torch.equal(rb.param_buffer, before.param_buffer)


def test_tile_table_arguments():
    with pytest.raises(ValueError, match="power of two"):
        fs.build_tile_table([], {}, {}, block=1000)
    (lay,) = build_layout([ParamSpec(0, 100, "k")], 1, 1000, 16)
    t = fs.build_tile_table(lay.pieces(0), {0: 0}, {}, block=32)
    assert t.numel.tolist() == [32, 32, 32, 4] and t.slot.tolist() == [-1] * 4 and t.align == 16


def test_adam_scalars_are_the_fp32_roundings_of_the_reference_scalars():
    s = fs.AdamScalars(7, 3e-4, 0.9, 0.95, 1e-8, 0.1, True)
    args = s.kernel_args()
    f32 = lambda x: torch.tensor(x, dtype=torch.float64).float().item()
    assert args["decay"] == f32(1 - 3e-4 * 0.1)
    assert args["neg_step_size"] == f32(-(3e-4 / (1 - 0.9**7)))
    assert args["bc2_sqrt"] == f32((1 - 0.95**7) ** 0.5)
    assert args["lerp_w"] == f32(1 - 0.9) and s.lerp_small
    assert not fs.AdamScalars(1, 1e-3, 0.5, 0.9, 1e-8, 0.0).lerp_small
    assert s.wd_mode == 1
    assert fs.AdamScalars(1, 1e-3, 0.9, 0.9, 1e-8, 0.1, False).wd_mode == 2
    assert fs.AdamScalars(1, 1e-3, 0.9, 0.9, 1e-8, 0.0, False).wd_mode == 0


def test_triton_module_imports_without_triton():
    mod = importlib.import_module("fp8shard.optim.triton_adam")
    assert isinstance(mod.HAVE_TRITON, bool)


# ============================================================================ reference path (CPU)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("adam_w", [True, False])
@pytest.mark.parametrize("mode", ["current", "delayed"])
def test_reference_ops_reproduce_the_optimizer_ops(dtype, adam_w, mode):
    """adam_tiles_ / cast_tiles_ / slot_amax on CPU == adam_ over runs + local_amax + cast_region."""
    sizes = [91, 300, 1, 2048, 77]
    rb = _region(3, 1, sizes, dtype, bucket=480, align=16, grad_dtype=torch.bfloat16)
    ref = _clone(rb)
    table = _tables(rb, len(sizes), 64)
    scalars = _scalars(adam_w)
    coef = torch.tensor(0.75)
    scale = torch.rand(len(sizes), generator=torch.Generator().manual_seed(3)) * 1000 + 1
    partial = torch.full((table.num_tiles,), float("nan"))
    out_mode = fs.OUT_PARAM if not rb.is_fp8 else (fs.OUT_AMAX if mode == "current" else fs.OUT_AMAX_CAST)
    fs.adam_tiles_(rb, table, scalars, out_mode=out_mode, grad_scale=coef, scale=scale,
                   partial_amax=partial if rb.is_fp8 else None)
    if rb.is_fp8 and mode == "current":
        fs.cast_tiles_(rb, table, scale)

    # what the optimizer does today, on the same buffers: fp32 grad copy, clip, adam_ per group
    grads = ref.grad_shard_fp32() * coef
    for g in (0, 1):
        pcs = [pc for pc in ref.pieces if pc.param_index % 2 == g]
        sl = [slice(pc.local_offset, pc.local_offset + pc.numel) for pc in pcs]
        hp = scalars[g]
        adam_([ref.master[s] for s in sl], [grads[s] for s in sl], [ref.exp_avg[s] for s in sl],
              [ref.exp_avg_sq[s] for s in sl], step=hp.step, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
              eps=hp.eps, weight_decay=hp.weight_decay, decoupled_weight_decay=adam_w)
    for k in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(rb, k), getattr(ref, k)), k
    if rb.is_fp8:
        fmt = Fp8Format.parse(dtype)
        scaler = Fp8WeightScaler({i: Float8Tensor.quantize(torch.ones(n), fmt) for i, n in enumerate(sizes)},
                                 "current", None, torch.device("cpu"))
        want_amax = scaler.local_amax([ref])
        assert torch.equal(fs.slot_amax([table], [partial], len(sizes), torch.device("cpu")), want_amax)
        # cast_region writes the whole shard (padding with scale 0): compare the tile bytes
        scaler.cast_region(ref, scale)
        for _, b, n, _ in table.spans():
            assert torch.equal(rb.param_buffer[b:b + n], ref.param_buffer[b:b + n])
    else:
        ref.write_param_shards(ref.master.to(ref.dtype))
        for _, b, n, _ in table.spans():
            assert torch.equal(rb.param_buffer[b:b + n], ref.param_buffer[b:b + n])


def _train(fused_path: bool | None, steps: int = 3, clip: float | None = None, nan_at: int | None = None,
           groups: bool = False, **kw) -> tuple[nn.Module, DistributedFusedAdam, list[float]]:
    torch.manual_seed(0)
    model = TinyMixed()
    # None: the optimizer's own choice (its ``fused`` argument, Triton)
    kernel = {None: "auto", True: "fused", False: "reference"}[fused_path]
    opt = DistributedFusedAdam(param_groups(model) if groups else model.parameters(), lr=2e-2,
                               weight_decay=0.05, bucket_cap_mb=TINY_BUCKET_MB, step_kernel=kernel, **kw)
    rank = dist.get_rank() if dist.is_initialized() else 0
    norms = []
    for step in range(1, steps + 1):
        factor = float("nan") if step == nan_at and rank == (1 if dist.is_initialized() else 0) else 1.0
        (model(batch(step, rank)).square().mean() * factor).backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm(clip)))
        opt.step()
        opt.zero_grad()
    return model, opt, norms


def _same_weights_and_state(a: nn.Module, oa: DistributedFusedAdam, b: nn.Module,
                            ob: DistributedFusedAdam) -> bool:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if isinstance(p, Float8Tensor):
            if not (torch.equal(p.uint8_view(), q.uint8_view()) and torch.equal(p._scale_inv, q._scale_inv)):
                return False
        elif not torch.equal(p.detach().view(torch.uint8), q.detach().view(torch.uint8)):
            return False
    sa, sb = oa.state_dict(), ob.state_dict()
    return all(torch.equal(sa["state"][i][k], sb["state"][i][k])
               for i in sa["state"] for k in ("master", "exp_avg", "exp_avg_sq"))


FUSED_CASES = [dict(), dict(adam_w_mode=False), dict(grad_sync_dtype=torch.float32),
               dict(state_dtype=torch.bfloat16), dict(fp8_weight_scaling="delayed"), dict(groups=True),
               dict(alignment=1)]


@pytest.mark.parametrize("case", FUSED_CASES,
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_fused_orchestration_is_bit_identical_on_cpu(case):
    """The fused path's orchestration (grads read in place, tile amax, cast after the all-reduce or
    in the Adam pass) with the reference ops gives today's results bit for bit."""
    a, oa, _ = _train(False, **case)
    b, ob, _ = _train(True, **case)
    assert ob._fused is not None and oa._fused is None
    assert _same_weights_and_state(a, oa, b, ob)


def test_fused_path_clips_in_kernel_and_skips_nonfinite_steps():
    _, oa, na = _train(False, steps=4, clip=1e-3, nan_at=3)
    _, ob, nb = _train(True, steps=4, clip=1e-3, nan_at=3)
    # The norm comes from per-shard norms of the bf16 buffer instead of one norm of an fp32 copy:
    # the same decision (non-finite at step 3), the value to rounding.
    assert na[2] != na[2] and nb[2] != nb[2]
    torch.testing.assert_close(torch.tensor(nb), torch.tensor(na), rtol=1e-6, atol=0, equal_nan=True)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["step"] == sb["step"] == 3
    for i in sa["state"]:
        for k in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sb["state"][i][k], sa["state"][i][k], rtol=1e-5, atol=1e-7)


def test_skipped_step_changes_nothing_on_the_fused_path():
    model, opt, _ = _train(True, steps=2)
    before = copy.deepcopy(opt.state_dict())
    weights = [p.uint8_view().clone() if isinstance(p, Float8Tensor) else p.detach().clone()
               for p in model.parameters()]
    (model(batch(9, 0)).square().mean() * float("nan")).backward()
    opt.step()
    assert opt.last_step_skipped
    after = opt.state_dict()
    assert after["step"] == before["step"]
    for i in before["state"]:
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after["state"][i][k], before["state"][i][k])
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p.uint8_view() if isinstance(p, Float8Tensor) else p.detach(), w)


def _fused_vs_reference_on_ranks(case: dict) -> bool:
    a, oa, _ = _train(False, **case)
    b, ob, _ = _train(True, **case)
    return _same_weights_and_state(a, oa, b, ob)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_orchestration_is_bit_identical_on_gloo_ranks(dist_pools, world_size):
    for case in (dict(), dict(fp8_weight_scaling="delayed", groups=True)):
        assert all(dist_pools(world_size).run(_fused_vs_reference_on_ranks, case))


# ============================================================================ GPU: the kernels
def _ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs().float()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def _assert_ulps(name: str, got: torch.Tensor, want: torch.Tensor, *magnitudes: torch.Tensor,
                 ulps: float = ULPS) -> dict[str, float]:
    """``|got - want| <= ulps * ulp(scale)``, scale the largest magnitude (see ``ULPS``); 16-bit
    tensors: one unit of their format. Returns statistics for reports."""
    scale = torch.stack([t.abs().float() for t in (got, want, *magnitudes)]).amax(0)
    unit = _ulp(scale)
    if got.dtype != torch.float32:
        ulps = 1.0
        unit = unit * (torch.finfo(got.dtype).eps / torch.finfo(torch.float32).eps)
    err = (got.double() - want.double()).abs()
    ratio = (err / unit.double()).nan_to_num(posinf=float("inf"))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    assert worst <= ulps, f"{name}: {worst:.2f} ulps (> {ulps}) at {int(ratio.argmax())}"
    return {"max_ulps": worst, "identical": float((got == want).float().mean()) if got.numel() else 1.0}


def _local_grads(rb: RegionBuffers, table: fs.TileTable, coef: float) -> torch.Tensor:
    out = torch.zeros_like(rb.master)
    for a, b, n, _ in table.spans():
        out[a:a + n] = rb.grad_buffer[b:b + n].float() * coef
    return out


def check_kernels(world: int, rank: int, sizes: list[int], dtype: torch.dtype, *, bucket: int, align: int,
                  grad_dtype: torch.dtype, state_dtype: torch.dtype, adam_w: bool, mode: str,
                  block: int, clip: bool, seed: int = 0, device: str = "cuda") -> dict[str, float]:
    """Triton kernels 1 and 2 against the reference on one random region (CUDA, or the CPU under
    the Triton interpreter)."""
    rb = _region(world, rank, sizes, dtype, bucket=bucket, align=align, grad_dtype=grad_dtype,
                 state_dtype=state_dtype, device=device, seed=seed)
    assert fs.use_triton(rb.master), "the Triton path is off (fp8shard.set_triton(False) or no triton)"
    old, ref = _clone(rb), _clone(rb)
    table = _tables(rb, len(sizes), block)
    scalars = _scalars(adam_w)
    coef = torch.tensor(0.6, device=device) if clip else None
    gen = torch.Generator().manual_seed(seed + 1)
    scale = (torch.rand(len(sizes), generator=gen) * 3000 + 0.5).to(device)
    fmt = Fp8Format.parse(dtype) if rb.is_fp8 else None
    out_mode = fs.OUT_PARAM if fmt is None else (fs.OUT_AMAX if mode == "current" else fs.OUT_AMAX_CAST)
    partial = torch.full((table.num_tiles,), float("nan"), device=device)  # every tile must write
    fs.adam_tiles_(rb, table, scalars, out_mode=out_mode, grad_scale=coef, scale=scale,
                   partial_amax=partial if fmt else None)
    if fmt is not None and mode == "current":
        fs.cast_tiles_(rb, table, scale)
    fs._adam_reference(ref, table, scalars, fs.OUT_NONE, coef, None, None, fused=False)

    covered = torch.zeros(rb.master.numel(), dtype=torch.bool, device=device)
    for a, _, n, _ in table.spans():
        covered[a:a + n] = True
    for k in ("master", "exp_avg", "exp_avg_sq"):  # nothing outside the tiles written
        assert torch.equal(getattr(rb, k)[~covered], getattr(old, k)[~covered]), k
    g = _local_grads(old, table, 0.6 if clip else 1.0)
    if not adam_w:
        g = g.abs() + 0.1 * old.master.abs()
    stats = {}
    stats["master"] = _assert_ulps("master", rb.master, ref.master, old.master, ref.master - old.master)
    stats["exp_avg"] = _assert_ulps("exp_avg", rb.exp_avg, ref.exp_avg, old.exp_avg.float(), g)
    stats["exp_avg_sq"] = _assert_ulps("exp_avg_sq", rb.exp_avg_sq, ref.exp_avg_sq)

    expected = old.param_buffer.clone()  # sentinel bytes everywhere but the tiles
    if fmt is not None:
        starts, lens = table.local_start.tolist(), table.numel.tolist()
        views = [rb.master[a:a + n] for a, n in zip(starts, lens, strict=True)]
        want_partial = torch.stack(torch._foreach_norm(views, float("inf"))).float()
        assert torch.equal(partial, want_partial), "tile amax"
        want_amax = torch.zeros(len(sizes), device=device)
        for a, _, n, s in table.spans():
            want_amax[s] = torch.maximum(want_amax[s], rb.master[a:a + n].abs().max())
        assert torch.equal(fs.slot_amax([table], [partial], len(sizes), rb.master.device), want_amax)
        for a, b, n, s in table.spans():
            cast_to_fp8(rb.master[a:a + n], scale[s], fmt, out=expected[b:b + n])
    else:
        for a, b, n, _ in table.spans():
            expected[b:b + n] = rb.master[a:a + n].to(rb.dtype)
    assert torch.equal(rb.param_buffer.view(torch.uint8), expected.view(torch.uint8)), "parameter bytes"
    return {f"{k}.{s}": v for k, st in stats.items() for s, v in st.items()}


LAYOUTS = [  # (world, rank, sizes, bucket, alignment, block)
    (1, 0, [7 * 13, 5000, 2048, 4097, 33, 1], 8192, 16, fs.DEFAULT_BLOCK),
    (3, 1, [300 * 77, 1000, 17, 65536, 5], 30000, 16, fs.DEFAULT_BLOCK),  # straddling shards
    (5, 4, [4096, 2049, 999], 2560, 16, 256),  # many buckets, small tiles
    (2, 1, [1001, 77, 3000], 960, 1, 512),  # unaligned: the kernels' scalar path
    (4, 0, [3], 1024, 16, fs.DEFAULT_BLOCK),  # one tiny masked tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"ws{x[0]}r{x[1]}a{x[4]}b{x[5]}")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32],
                         ids=str)
def test_triton_kernels_match_the_reference(layout, dtype):
    fp8shard.set_triton(True)
    check_layout(layout, dtype, "cuda")


def check_layout(layout: tuple, dtype: torch.dtype, device: str) -> None:
    """``check_kernels`` on one of ``LAYOUTS`` with four (grad dtype, AdamW or L2, scaling) combos."""
    world, rank, sizes, bucket, align, block = layout
    combos = [(torch.bfloat16, True, "current"), (torch.float32, False, "delayed"),
              (torch.bfloat16, False, "current"), (torch.float32, True, "delayed")]
    for i, (grad_dtype, adam_w, mode) in enumerate(combos):
        check_kernels(world, rank, sizes, dtype, bucket=bucket, align=align, grad_dtype=grad_dtype,
                      state_dtype=torch.float32, adam_w=adam_w, mode=mode, block=block, clip=i % 2 == 0,
                      seed=i, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_kernels_with_16bit_states(state_dtype):
    fp8shard.set_triton(True)
    for mode in ("current", "delayed"):
        check_kernels(3, 2, [5000, 77, 2048], torch.float8_e4m3fn, bucket=4096, align=16,
                      grad_dtype=torch.bfloat16, state_dtype=state_dtype, adam_w=True, mode=mode,
                      block=fs.DEFAULT_BLOCK, clip=False)


def check_cast_keeps_nan_and_saturates(device: str) -> None:
    rb = _region(1, 0, [4096, 100], torch.float8_e4m3fn, bucket=8192, align=16, device=device)
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, -0.0,
                            1e-30, -1e-30, 448.0, 464.0, -464.0], device=device)
    rb.master[:special.numel()] = special
    table = _tables(rb, 2, fs.DEFAULT_BLOCK)
    scale = torch.tensor([1.0, 2.0], device=device)
    fs.cast_tiles_(rb, table, scale)
    for a, b, n, s in table.spans():
        want = cast_to_fp8(rb.master[a:a + n], scale[s], Fp8Format.E4M3).view(torch.uint8)
        got = rb.param_buffer[b:b + n]
        nan = torch.isnan(rb.master[a:a + n])
        assert torch.equal(got[~nan], want[~nan])
        assert ((got[nan] & 0x7F) == 0x7F).all()  # NaN stays NaN (0x7F / 0xFF)


def check_slot_amax_keeps_nan_and_inf(device: str) -> None:
    """Kernel 1's tile amaxes and their per-slot max: a NaN of either sign in the new master
    gives NaN, an inf gives inf, whatever the slot's other tiles hold; -0.0 counts as 0."""
    sizes = [4096, 3000, 100]
    rb = _region(1, 0, sizes, torch.float8_e4m3fn, bucket=8192, align=16, device=device)
    table = _tables(rb, len(sizes), 512)
    starts = {s: a for a, _, _, s in reversed(table.spans())}  # each slot's first tile
    rb.master[starts[0] + 700] = -float("nan")  # a later tile of slot 0
    rb.master[starts[1] + 5] = float("inf")
    rb.master[starts[2]:starts[2] + 100] = -0.0
    rb.exp_avg[starts[2]:starts[2] + 100] = 0.0
    rb.grad_buffer.zero_()
    partial = torch.full((table.num_tiles,), -1.0, device=device)
    fs.adam_tiles_(rb, table, _scalars(True), out_mode=fs.OUT_AMAX, partial_amax=partial)
    amax = fs.slot_amax([table], [partial], len(sizes), rb.master.device)
    assert amax[0].isnan() and amax[1].item() == float("inf")
    assert amax[2].item() == 0.0 and not amax[2].signbit()


def fp8_encoding_inputs(n_random: int) -> torch.Tensor:
    """``n_random`` random fp32 bit patterns (NaN, inf, subnormals included), then every finite
    FP8 value of both formats, the midpoints between neighbours (exact ties) and the fp32
    neighbours of each."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (n_random,), generator=gen, dtype=torch.int64).to(torch.int32)
    parts = [bits.view(torch.float32)]
    for fmt in Fp8Format:
        v = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float()
        v = v[torch.isfinite(v)].sort().values
        mid = (v[1:] + v[:-1]) / 2
        for t in (v, mid):
            parts += [t, torch.nextafter(t, t + 1), torch.nextafter(t, t - 1)]
    return torch.cat(parts)


def check_fp8_encoding(n_random: int, device: str) -> None:
    """Kernel 2 (the cast) writes exactly ``cast_to_fp8``'s bytes for every input of
    ``fp8_encoding_inputs``; a NaN stays NaN (0x7F, either sign)."""
    x = fp8_encoding_inputs(n_random).to(device)
    for fmt in Fp8Format:
        (lay,) = build_layout([ParamSpec(0, x.numel(), fmt.torch_dtype), ParamSpec(1, 5, fmt.torch_dtype)],
                              1, 1 << 30, 16)
        rb = RegionBuffers(lay, 0, torch.device(device), torch.bfloat16, torch.float32)
        rb.master[:x.numel()] = x
        table = fs.build_tile_table(rb.pieces, {0: 0, 1: 0}, {0: 0, 1: 1}, device=device)
        fs.cast_tiles_(rb, table, torch.tensor([1.0, 1.0], device=device))
        got = rb.param_buffer[:x.numel()]
        want = cast_to_fp8(x, torch.tensor(1.0, device=device), fmt).view(torch.uint8)
        nan = torch.isnan(x)
        assert torch.equal(got[~nan], want[~nan]), f"{fmt.name}: {int((got[~nan] != want[~nan]).sum())} bytes"
        assert ((got[nan] & 0x7F) == 0x7F).all(), f"{fmt.name}: a NaN was not written as NaN"


@pytest.mark.gpu
def test_triton_cast_encodes_every_fp8_boundary_and_random_bits():
    """2M random fp32 bit patterns and every FP8 boundary, both formats."""
    fp8shard.set_triton(True)
    check_fp8_encoding(1 << 21, "cuda")


@pytest.mark.gpu
def test_triton_cast_keeps_nan_and_saturates():
    fp8shard.set_triton(True)
    check_cast_keeps_nan_and_saturates("cuda")


@pytest.mark.gpu
def test_triton_slot_amax_keeps_nan_and_inf():
    fp8shard.set_triton(True)
    check_slot_amax_keeps_nan_and_inf("cuda")


def test_reference_slot_amax_keeps_nan_and_inf():
    check_slot_amax_keeps_nan_and_inf("cpu")

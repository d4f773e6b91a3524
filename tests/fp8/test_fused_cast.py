"""The fused casts ([Note: fused cast] in fp8shard/fp8/fused.py).

CPU: the dispatch functions (which take the reference path there) agree bit for bit with the
eager functions they replace. GPU (``-m gpu``, on the H200): the Triton path agrees bit for bit
with the reference path on fresh random inputs, special values and odd shapes, writes every
output element (outputs poisoned first), and was really the path taken. CPU again: the same
kernels under Triton's interpreter (tests/triton_interp.py), bit for bit but for NaN signs.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8shard as fs
from fp8shard.fp8 import fused
from fp8shard.fp8.cast import cast_to_fp8
from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.scaling import amax as eager_amax
from fp8shard.fp8.scaling import scale_from_amax

FORMATS = [Fp8Format.E4M3, Fp8Format.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["randn", "wide", "nan", "neg_nan", "inf", "zeros", "tiny"]


def make_input(shape, dtype, kind: str, device="cpu", seed=0) -> torch.Tensor:
    """Fresh inputs of a few kinds: plain, wide range, NaN (both signs), inf, all zeros, tiny."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    n = x.numel()
    flat = x.view(-1)
    if kind == "wide":
        flat *= torch.exp2(torch.randint(-20, 12, (n,), generator=g).float())
    elif kind in ("nan", "neg_nan", "inf"):
        idx = torch.randint(0, n, (max(1, n // 97),), generator=g)
        if kind == "inf":
            flat[idx] = torch.where(torch.rand(idx.shape, generator=g) < 0.5, -math.inf, math.inf)
        else:
            flat[idx] = math.nan if kind == "nan" else -torch.tensor(math.nan)
    elif kind == "zeros":
        x.zero_()
    elif kind == "tiny":  # subnormal in fp16; tiny but normal elsewhere
        flat *= 1e-6
    return x.to(dtype).to(device)


def bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        return False
    if a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    same = a.contiguous().view(as_int) == b.contiguous().view(as_int)
    if a.element_size() > 1 and a.is_floating_point():  # NaN payloads may differ
        same |= a.isnan() & b.isnan()
    return bool(same.all())


def assert_same_cast(got: fused.Fp8Cast, ref: fused.Fp8Cast) -> None:
    assert got.data.dtype == ref.data.dtype
    assert bits_equal(got.data, ref.data), "FP8 bytes differ"
    assert bits_equal(got.data_t, ref.data_t), "transposed FP8 bytes differ"
    assert bits_equal(got.scale_inv, ref.scale_inv), (got.scale_inv, ref.scale_inv)
    assert bits_equal(got.amax, ref.amax), (got.amax, ref.amax)


# ------------------------------------------------------------------------------------- CPU
def _eager_current(x, fmt, transpose=False, prev_scale_inv=None):
    """The code the fused casts replaced (Float8Tensor.quantize / quantize_ / Linear)."""
    a = eager_amax(x)
    prev = None if prev_scale_inv is None else prev_scale_inv.reciprocal()
    scale = scale_from_amax(a, fmt.max, prev)
    data = cast_to_fp8(x, scale, fmt)
    return fused.Fp8Cast(data, data.t().contiguous() if transpose else None, scale.reciprocal(), a)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (129, 67)])
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
def test_quantize_current_matches_eager(shape, dtype, fmt, kind, transpose):
    x = make_input(shape, dtype, kind, seed=sum(shape) + KINDS.index(kind))
    before = sum(fused.triton_calls.values())
    got = fused.quantize_current(x, fmt, transpose=transpose)
    assert sum(fused.triton_calls.values()) == before  # CPU: the reference path
    assert_same_cast(got, _eager_current(x, fmt, transpose))
    if transpose:
        assert got.data_t.is_contiguous() and got.data_t.shape == (shape[1], shape[0])


@pytest.mark.parametrize("kind", ["randn", "nan", "zeros"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_with_scale_matches_eager_and_folds_amax(fmt, kind):
    x = make_input((37, 21), torch.bfloat16, kind, seed=3)
    scale = torch.tensor(3.7)
    history = torch.tensor([[0.25, 1e9], [5.0, 6.0]])  # amax_out is a view, as in Linear
    got = fused.quantize_with_scale(x, scale, fmt, transpose=True, amax_out=history[0, 0])
    data = cast_to_fp8(x, scale, fmt)
    want = fused.Fp8Cast(data, data.t().contiguous(), scale.reciprocal(), None)
    assert_same_cast(got._replace(amax=None), want)
    expect = torch.maximum(torch.tensor(0.25), eager_amax(x))
    assert bits_equal(history[0, 0], expect) and bits_equal(got.amax, expect)
    assert history[0, 1].item() == 1e9 and history[1].tolist() == [5.0, 6.0]
    without = fused.quantize_with_scale(x, scale, fmt)
    assert without.amax is None and without.data_t is None and bits_equal(without.data, data)


def test_zero_or_nonfinite_amax_keeps_previous_scale():
    prev_inv = torch.tensor(0.125)
    for x in (torch.zeros(4, 4), torch.full((4, 4), math.nan), torch.full((4, 4), math.inf)):
        got = fused.quantize_current(x, Fp8Format.E4M3, prev_scale_inv=prev_inv)
        assert got.scale_inv.item() == 0.125
        assert_same_cast(got, _eager_current(x, Fp8Format.E4M3, prev_scale_inv=prev_inv))
    assert fused.quantize_current(torch.zeros(3), "e4m3").scale_inv.item() == 1.0


@pytest.mark.parametrize("out_dtype", [torch.float8_e5m2, torch.uint8])
def test_out_argument_is_written_and_returned(out_dtype):
    x = make_input((10, 6), torch.float32, "randn")
    out = torch.empty(10, 6, dtype=out_dtype)
    got = fused.quantize_current(x, Fp8Format.E5M2, out=out)
    assert got.data is out
    assert bits_equal(out.view(torch.float8_e5m2), _eager_current(x, Fp8Format.E5M2).data)


def test_transpose_needs_2d():
    with pytest.raises(ValueError, match="2-D"):
        fused.quantize_current(torch.randn(2, 3, 4), Fp8Format.E4M3, transpose=True)
    with pytest.raises(ValueError, match="2-D"):
        fused.quantize_with_scale(torch.randn(5), torch.tensor(1.0), Fp8Format.E4M3, transpose=True)


def test_empty_and_any_rank_inputs():
    for shape in [(0,), (0, 5), (), (3,), (2, 3, 5)]:
        x = torch.randn(shape)
        assert_same_cast(fused.quantize_current(x, Fp8Format.E4M3), _eager_current(x, Fp8Format.E4M3))


def test_float8tensor_quantize_paths_match_eager():
    x = make_input((33, 17), torch.bfloat16, "wide", seed=5)
    t = fs.Float8Tensor.quantize(x, "e4m3")
    assert_same_cast(fused.Fp8Cast(t.fp8_data, None, t.scale_inv, None),
                     _eager_current(x, Fp8Format.E4M3)._replace(amax=None))
    t2 = fs.Float8Tensor.quantize(x, "e4m3", scale=2.0)
    assert bits_equal(t2.fp8_data, cast_to_fp8(x, torch.tensor(2.0), Fp8Format.E4M3))
    assert t2.scale_inv.item() == 0.5
    t.quantize_(torch.zeros_like(x))  # zero amax: the scale stays
    assert bits_equal(t.scale_inv, _eager_current(x, Fp8Format.E4M3).scale_inv)
    assert t.fp8_data.view(torch.uint8).eq(0).all()


def test_triton_module_imports_without_triton():
    from fp8shard.fp8 import triton_cast

    if triton_cast.triton is None:  # this machine: the module imports, launching says why not
        with pytest.raises(RuntimeError, match="Triton"):
            triton_cast.launch_cast(torch.ones(2), Fp8Format.E4M3, torch.empty(2, dtype=torch.uint8),
                                    None, torch.empty(()), amax=torch.empty(()))


# ------------------------------------------------------------------------------------- GPU
GPU_SHAPES = [(1, 1), (7, 13), (3, 8195), (1031, 4096), (4096, 1031), (2048, 2048), (8191, 129)]


def _poisoned_launch(x, fmt, transpose, poison, *, scale=None, prev_scale_inv=None, amax_out=None):
    """The Triton kernels on outputs filled with ``poison``: unwritten elements keep it."""
    from fp8shard.fp8 import triton_cast

    data = torch.full(x.shape, poison, dtype=torch.uint8, device=x.device)
    data_t = (torch.full((x.shape[1], x.shape[0]), poison, dtype=torch.uint8, device=x.device)
              if transpose else None)
    scale_inv = torch.full((), math.nan, device=x.device)
    amax = torch.full((), -7.0, device=x.device) if scale is None else None
    triton_cast.launch_cast(x, fmt, data, data_t, scale_inv, scale=scale,
                            prev_scale_inv=prev_scale_inv, amax=amax, amax_out=amax_out)
    view = fmt.torch_dtype
    return fused.Fp8Cast(data.view(view), None if data_t is None else data_t.view(view), scale_inv,
                         amax if scale is None else amax_out)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_triton_current_is_bit_exact(shape, dtype, fmt, kind):
    x = make_input(shape, dtype, kind, device="cuda", seed=17)
    for transpose in (False, True):
        ref = fused.reference_quantize_current(x, fmt, transpose=transpose)
        for poison in (0xAB, 0x5C):
            assert_same_cast(_poisoned_launch(x, fmt, transpose, poison), ref)
        before = fused.triton_calls["quantize_current"]
        got = fused.quantize_current(x, fmt, transpose=transpose)
        assert fused.triton_calls["quantize_current"] == before + 1, "the Triton path was not taken"
        assert_same_cast(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["randn", "wide", "nan", "neg_nan", "inf", "zeros"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_triton_with_scale_is_bit_exact(shape, dtype, fmt, kind):
    x = make_input(shape, dtype, kind, device="cuda", seed=23)
    for scale_value in (0.37, 2.0**-10, 1e4):  # 1e4 saturates most elements
        scale = torch.tensor(scale_value, device="cuda")
        for transpose in (False, True):
            for start in (0.5, math.nan):  # the running amax it folds into
                ref_amax = torch.tensor(start, device="cuda")
                ref = fused.reference_quantize_with_scale(x, scale, fmt, transpose=transpose,
                                                          amax_out=ref_amax)
                amax_out = torch.tensor(start, device="cuda")
                got = _poisoned_launch(x, fmt, transpose, 0xAB, scale=scale, amax_out=amax_out)
                assert_same_cast(got, ref)
            before = fused.triton_calls["quantize_with_scale"]
            got = fused.quantize_with_scale(x, scale, fmt, transpose=transpose)
            assert fused.triton_calls["quantize_with_scale"] == before + 1
            assert_same_cast(got, fused.reference_quantize_with_scale(x, scale, fmt, transpose=transpose))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_rounds_ties_to_even_and_saturates(fmt):
    # Every FP8 value, the midpoints between neighbours (exact ties) and points just off them.
    vals = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).double()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids * (1 + 2.0**-20), mids * (1 - 2.0**-20),
                   torch.tensor([fmt.max * 1.01, -fmt.max * 1.5, 1e30, -1e30])])
    x = x.float().cuda().reshape(1, -1)
    one = torch.tensor(1.0, device="cuda")
    ref = fused.reference_quantize_with_scale(x, one, fmt, transpose=True)
    assert_same_cast(_poisoned_launch(x, fmt, True, 0xAB, scale=one), ref)


@pytest.mark.gpu
def test_triton_keeps_previous_scale_and_writes_into_out():
    x = torch.zeros(300, 77, device="cuda", dtype=torch.bfloat16)
    prev = torch.tensor(0.0625, device="cuda")
    ref = fused.reference_quantize_current(x, Fp8Format.E4M3, prev_scale_inv=prev)
    assert_same_cast(_poisoned_launch(x, Fp8Format.E4M3, False, 0xAB, prev_scale_inv=prev), ref)
    y = make_input((300, 77), torch.float16, "wide", device="cuda", seed=2)
    out = torch.full((300, 77), 0xAB, dtype=torch.uint8, device="cuda")
    got = fused.quantize_current(y, Fp8Format.E5M2, prev_scale_inv=prev, out=out)
    assert got.data is out
    assert_same_cast(got._replace(data=out.view(torch.float8_e5m2)),
                     fused.reference_quantize_current(y, Fp8Format.E5M2, prev_scale_inv=prev))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2**31 + 8192 * 3 + 5,), (32768 + 64, 65536 + 3)])
def test_triton_tensors_past_2_to_the_31_elements(shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x.view(-1)[-1] = 1000.0  # the amax sits in the last element
    transpose = len(shape) == 2
    ref = fused.reference_quantize_current(x, Fp8Format.E4M3, transpose=transpose)
    assert ref.amax.item() == 1000.0
    assert_same_cast(_poisoned_launch(x, Fp8Format.E4M3, transpose, 0xAB), ref)


@pytest.mark.gpu
def test_float8tensor_quantize_takes_the_triton_path():
    x = make_input((513, 257), torch.bfloat16, "wide", device="cuda", seed=9)
    before = fused.triton_calls["quantize_current"]
    t = fs.Float8Tensor.quantize(x, "e4m3")
    assert fused.triton_calls["quantize_current"] == before + 1
    t.quantize_(x * 3)
    assert fused.triton_calls["quantize_current"] == before + 2
    fs.set_triton(False)
    r = fs.Float8Tensor.quantize(x, "e4m3")
    r.quantize_(x * 3)
    assert fused.triton_calls["quantize_current"] == before + 2
    assert bits_equal(t.fp8_data, r.fp8_data) and bits_equal(t.scale_inv, r.scale_inv)


def _linear_run(recipe, fp8_params: bool, shape, dtype):
    torch.manual_seed(0)
    with fs.fp8_model_init(enabled=fp8_params):
        layer = fs.nn.Linear(shape[-1], 96, device="cuda", dtype=dtype)
    sync = fs.nn.AmaxSync(layer)  # delayed scaling: the amax update after each backward
    outs = []
    for step in range(3):  # delayed scaling: steps 2 and 3 use scales from the history
        g = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(shape, device="cuda", dtype=dtype, generator=g).requires_grad_()
        dy = torch.randn(*shape[:-1], 96, device="cuda", dtype=dtype, generator=g)
        with fs.fp8_autocast(enabled=True, recipe=recipe):
            y = layer(x)
        y.backward(dy)
        sync.step()
        outs += [y.detach(), x.grad, layer.weight.grad.clone()]
        layer.weight.grad = None
    for name in ("fp8_amax_history", "fp8_scale"):
        if hasattr(layer, name):
            outs.append(getattr(layer, name).clone())
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [fs.CurrentScaling(), fs.DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
@pytest.mark.parametrize("fp8_params", [False, True], ids=["hp_weight", "fp8_weight"])
@pytest.mark.parametrize("shape", [(4, 64, 256), (3, 37, 48)], ids=["aligned", "odd"])
def test_linear_triton_equals_reference_bit_for_bit(recipe, fp8_params, shape):
    fs.set_triton(True)
    before = sum(fused.triton_calls.values())
    got = _linear_run(recipe, fp8_params, shape, torch.bfloat16)
    assert sum(fused.triton_calls.values()) > before, "the Triton path was not taken"
    fs.set_triton(False)
    ref = _linear_run(recipe, fp8_params, shape, torch.bfloat16)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.dtype == b.dtype and bits_equal(a.view(-1), b.view(-1)), f"output {i} differs"


# ----------------------------------------------------------------- CPU: the kernels interpreted
# The GPU tests' checks with the kernels run by Triton's interpreter (tests/triton_interp.py) on
# CPU tensors, so CI covers the kernels' indexing, masks, partial amaxes, scale arithmetic,
# transposed tiles and dispatch. One difference is allowed: the sign of a NaN's byte. IEEE leaves
# the sign of a NaN out of arithmetic unspecified; the H200 (and the CUDA reference) return the
# canonical positive NaN from ``x * scale``, numpy keeps the operand's sign. The GPU tests compare
# those bytes exactly.
INTERP_SHAPES = [(1, 1), (7, 13), (3, 8195), (130, 70)]
# numpy warns where the reference's guards expect it (a zero amax's reciprocal is never used).
ignore_numpy_divide = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


@pytest.fixture
def interpreted_casts(monkeypatch):
    from fp8shard.fp8 import triton_cast
    from tests.triton_interp import interpreted

    with interpreted(monkeypatch, triton_cast):
        # The host code's CUDA queries: a 4-SM device, one program per SM, no device switch.
        monkeypatch.setattr(triton_cast, "_device_limits", lambda index: (4, 65536, 2048, 228 * 1024))
        monkeypatch.setattr(triton_cast, "_fit", lambda compiled, num_warps, index: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
        monkeypatch.setattr(fused, "use_triton", lambda *tensors: True)
        yield


def _nan_sign_free(c: fused.Fp8Cast) -> fused.Fp8Cast:
    def fix(t):
        if t is None:
            return None
        u = t.view(torch.uint8).clone()
        u[t.float().isnan()] = 0x7F
        return u.view(t.dtype)
    return c._replace(data=fix(c.data), data_t=fix(c.data_t))


def assert_same_cast_interp(got: fused.Fp8Cast, ref: fused.Fp8Cast) -> None:
    assert_same_cast(_nan_sign_free(got), _nan_sign_free(ref))


@ignore_numpy_divide
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreted_current_is_bit_exact(dtype, fmt, interpreted_casts):
    for shape in INTERP_SHAPES:
        for kind in KINDS:
            x = make_input(shape, dtype, kind, seed=17)
            for transpose in (False, True):
                ref = fused.reference_quantize_current(x, fmt, transpose=transpose)
                assert_same_cast_interp(_poisoned_launch(x, fmt, transpose, 0xAB), ref)


@ignore_numpy_divide
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreted_with_scale_is_bit_exact(dtype, fmt, interpreted_casts):
    for shape in [(1, 1), (7, 13), (130, 70)]:
        for kind in ("randn", "wide", "nan", "zeros"):
            x = make_input(shape, dtype, kind, seed=23)
            for scale_value, transpose, start in ((0.37, False, 0.5), (2.0**-10, True, math.nan),
                                                  (1e4, True, 0.5)):  # 1e4 saturates most elements
                scale = torch.tensor(scale_value)
                ref_amax = torch.tensor(start)
                ref = fused.reference_quantize_with_scale(x, scale, fmt, transpose=transpose,
                                                          amax_out=ref_amax)
                amax_out = torch.tensor(start)
                got = _poisoned_launch(x, fmt, transpose, 0xAB, scale=scale, amax_out=amax_out)
                assert_same_cast_interp(got, ref)


@ignore_numpy_divide
@pytest.mark.parametrize("fmt", FORMATS)
def test_interpreted_rounds_ties_to_even_and_saturates(fmt, interpreted_casts):
    vals = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).double()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids * (1 + 2.0**-20), mids * (1 - 2.0**-20),
                   torch.tensor([fmt.max * 1.01, -fmt.max * 1.5, 1e30, -1e30])])
    x = x.float().reshape(1, -1)
    one = torch.tensor(1.0)
    ref = fused.reference_quantize_with_scale(x, one, fmt, transpose=True)
    assert_same_cast(_poisoned_launch(x, fmt, True, 0xAB, scale=one), ref)  # no NaN: exact


@ignore_numpy_divide
def test_interpreted_keeps_previous_scale_and_serves_quantize(interpreted_casts):
    x = torch.zeros(300, 77, dtype=torch.bfloat16)
    prev = torch.tensor(0.0625)
    ref = fused.reference_quantize_current(x, Fp8Format.E4M3, prev_scale_inv=prev)
    assert_same_cast(_poisoned_launch(x, Fp8Format.E4M3, False, 0xAB, prev_scale_inv=prev), ref)
    y = make_input((130, 70), torch.bfloat16, "wide", seed=9)
    before = fused.triton_calls["quantize_current"]
    t = fs.Float8Tensor.quantize(y, "e4m3")  # dispatched to the (interpreted) Triton path
    assert fused.triton_calls["quantize_current"] == before + 1
    r = fused.reference_quantize_current(y, Fp8Format.E4M3)
    assert bits_equal(t.fp8_data, r.data) and bits_equal(t.scale_inv, r.scale_inv)

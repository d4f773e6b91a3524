"""The FP8 GEMM: ``torch._scaled_mm`` where it can serve, padding or emulation where it cannot.

[Note: three GEMMs] gives the operands; this module only knows one product
``out = (a · b) * a_scale_inv * b_scale_inv`` of an ``[M, K]`` row-major FP8 ``a`` and a
``[K, N]`` column-major FP8 ``b``, accumulated in fp32 and returned as ``out_dtype``.

Which path serves a product is decided from the device and the dims alone, so it is the same
for every call of a shape and can be folded into a ``torch.compile`` graph as a constant:

* ``"scaled_mm"``: ``torch._scaled_mm`` directly (CPU: any dims, where it is fast -- see
  below; CUDA sm89+: dims multiples of 16).
* ``"padded"``: CUDA sm89+ with a dim that is not a multiple of 16. The operands are padded
  with zero bytes up to multiples of 16; zeros in K add nothing to the sums and extra rows or
  columns of M and N are sliced off, so the product is the same, still on FP8 tensor cores.
* ``"emulated"``: everywhere else (GPUs older than sm89, other devices). The FP8 values are
  dequantized and multiplied in fp32: same rounding of the inputs, high-precision product.

[Note: CPU GEMM choice]
    On CPU, ``torch._scaled_mm`` is oneDNN's: fast where the CPU (or oneDNN's build) has an FP8
    kernel, and oneDNN's *reference* kernel where it has none (e.g. AVX-512 + AMX Xeons without
    FP8), 400-600x slower than a bf16 matmul of the same shape. The emulated path (FP8 values
    widened to fp32, one fp32 product, scaled once) gives the same result up to the order of the
    fp32 sums. So the CPU default (``"auto"``) is the emulated path unless a one-time
    measurement at first use (:func:`measure_cpu_gemm`, a fraction of a second even against the
    reference kernel) shows ``torch._scaled_mm`` is not slower on the machine at hand.
    :func:`set_fp8_gemm` (the training command's ``model.fp8_gemm``) forces either path.

A path other than ``"scaled_mm"`` is reported once per process and reason (``warnings`` and
``logging``), because it costs speed, not correctness. Under ``torch.compile`` the report and
the device query run once, while the graph is traced (``assume_constant_result``): no graph
break, and the path is a constant of the graph.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

PATHS = ("scaled_mm", "padded", "emulated")
SETTINGS = ("auto", "scaled_mm", "emulated")
_ALIGN = 16
_forced_path: str | None = None
_setting = "auto"
_cpu_auto: dict[str, object] = {}  # the measured CPU choice, once per process
_reported: set[str] = set()


def set_fp8_gemm(setting: str) -> None:
    """How every FP8 GEMM of this process is served ([Note: CPU GEMM choice]).

    ``"auto"`` (default): CUDA sm89+ uses ``torch._scaled_mm`` (padded where dims are not
    multiples of 16); CPU uses the emulated path unless a one-time measurement shows
    ``torch._scaled_mm`` is not slower. ``"scaled_mm"``: always ``torch._scaled_mm`` (padded on
    CUDA where needed). ``"emulated"``: FP8 inputs widened to fp32, product in fp32, everywhere.
    """
    global _setting
    if setting not in SETTINGS:
        raise ValueError(f"unknown FP8 GEMM setting {setting!r}; choose one of {', '.join(SETTINGS)}")
    _setting = setting


def get_fp8_gemm() -> str:
    """The setting made with :func:`set_fp8_gemm` (``"auto"`` unless changed)."""
    return _setting


@contextlib.contextmanager
def force_gemm_path(path: str | None) -> Iterator[None]:
    """Use ``path`` for every FP8 GEMM inside (tests and benchmarks compare the paths)."""
    global _forced_path
    if path is not None and path not in PATHS:
        raise ValueError(f"unknown GEMM path {path!r}; choose one of {PATHS}")
    previous, _forced_path = _forced_path, path
    try:
        yield
    finally:
        _forced_path = previous


def _constant_under_compile(fn):  # type: ignore[no-untyped-def]
    """``torch.compiler.assume_constant_result`` without importing Dynamo: that decorator
    imports ``torch._dynamo`` (about a second, half of what importing fp8shard costs) to set
    one attribute, which Dynamo reads when it traces a call. A process that never compiles need
    not pay for it at import (the command-line tools; a training run loads Dynamo anyway once
    it builds the model on the meta device, whose ops go through torch's reference
    implementations). ``tests/test_import.py`` checks that both mark a function alike."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def _report_once(reason: str, message: str) -> bool:
    # Under torch.compile this runs (natively) while the graph is traced, so a compiled first
    # call reports too, and logging/warnings cause no graph break.
    if reason not in _reported:
        _reported.add(reason)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return True


_FP8_CAPABLE: dict[int, bool] = {}


@_constant_under_compile
def _cuda_fp8_capable(device_index: int) -> bool:
    # Cached; under torch.compile a constant of the graph (the driver query would break it).
    if device_index not in _FP8_CAPABLE:
        _FP8_CAPABLE[device_index] = torch.cuda.get_device_capability(device_index) >= (8, 9)
    return _FP8_CAPABLE[device_index]


def _time_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure_cpu_gemm(m: int = 128, k: int = 256, n: int = 256, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` milliseconds of one ``[m, k] x [k, n]`` FP8 GEMM on CPU, per path.

    ``torch._scaled_mm`` is timed again only while it is within 4x of the emulated path, so a
    reference kernel costs two calls (about half a second on such a CPU), once per process.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).t()  # [k, n] column-major
    one = torch.ones((), dtype=torch.float32)
    emulated = lambda: _emulated_mm(a, one, b, one, torch.bfloat16)
    scaled = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    scaled()  # first calls pay one-time set-up costs
    emulated()
    t_emulated = _time_ms(emulated, repeats)
    t_scaled = _time_ms(scaled, 1)
    if t_scaled <= 4 * t_emulated:
        t_scaled = min(t_scaled, _time_ms(scaled, repeats - 1))
    return {"scaled_mm_ms": t_scaled, "emulated_ms": t_emulated}


@_constant_under_compile
def _cpu_auto_path() -> str:
    # Measured once per process, natively (under torch.compile: while tracing, then a constant).
    if "path" not in _cpu_auto:
        timings = measure_cpu_gemm()
        _cpu_auto.update(timings)
        _cpu_auto["path"] = "scaled_mm" if timings["scaled_mm_ms"] <= timings["emulated_ms"] else "emulated"
    return str(_cpu_auto["path"])


def cpu_gemm_choice() -> dict[str, object]:
    """What ``"auto"`` picks on CPU and the timings it picked from (measuring on first use)."""
    _cpu_auto_path()
    return dict(_cpu_auto)


def resolved_gemm_path(device_type: str) -> str:
    """The path ``"scaled_mm"`` or ``"emulated"`` this process uses on ``device_type`` for
    aligned dims, after the setting and (CPU ``"auto"``) the measurement."""
    if _forced_path is not None:
        return _forced_path
    if _setting != "auto":
        return _setting
    if device_type == "cpu":
        return _cpu_auto_path()
    return "scaled_mm" if device_type == "cuda" else "emulated"


def choose_gemm_path(device_type: str, device_index: int, m: int, k: int, n: int) -> str:
    """The path that serves an ``[m, k] x [k, n]`` FP8 product on this device (see module doc).

    Plain Python on the dims: under ``torch.compile`` the branch becomes a shape guard.
    """
    if _forced_path is not None:
        return _forced_path
    if _setting == "emulated":
        return "emulated"
    if device_type == "cpu":
        return "scaled_mm" if _setting == "scaled_mm" else _cpu_auto_path()
    if device_type == "cuda" and _cuda_fp8_capable(device_index):
        if m % _ALIGN == 0 and k % _ALIGN == 0 and n % _ALIGN == 0:
            return "scaled_mm"
        _report_once(
            "padded",
            f"fp8shard: FP8 GEMM dims {m}x{k}x{n} are not all multiples of {_ALIGN}; padding the "
            "operands for torch._scaled_mm (exact, but costs a copy). Use multiples of 16 for speed.",
        )
        return "padded"
    _report_once(
        f"emulated-{device_type}",
        f"fp8shard: torch._scaled_mm needs a CPU or a CUDA GPU of compute capability 8.9+; on "
        f"{device_type} the FP8 GEMMs are emulated (inputs rounded through FP8, product in fp32).",
    )
    return "emulated"


def fp8_mm(
    a_fp8: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_fp8_colmajor: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a · b) * a_scale_inv * b_scale_inv (+ bias)`` as ``out_dtype``; a: [M, K], b: [K, N] FP8.

    ``a_fp8`` must be row-major and ``b_fp8_colmajor`` column-major (``b.t()`` contiguous), the
    layout ``torch._scaled_mm`` wants; the scales are fp32 0-d inverse scales ([Note: scale]).
    ``bias`` ([N], any float dtype) is added in fp32 before the one rounding to ``out_dtype``
    ([Note: bias epilogue]).
    """
    m, k = a_fp8.shape
    n = b_fp8_colmajor.shape[1]
    device = a_fp8.device
    path = choose_gemm_path(device.type, device.index or 0, m, k, n)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_mm: bias of shape {tuple(bias.shape)} for an output of {n} columns; "
                         f"pass a 1-D bias of length {n}")
    if path == "emulated":
        return _emulated_mm(a_fp8, a_scale_inv, b_fp8_colmajor, b_scale_inv, out_dtype, bias)
    if path == "padded":
        return _padded_mm(a_fp8, a_scale_inv, b_fp8_colmajor, b_scale_inv, out_dtype, bias)
    return _scaled_mm(a_fp8, b_fp8_colmajor, a_scale_inv, b_scale_inv, out_dtype, bias)


# [Note: bias epilogue]
#     torch._scaled_mm adds a bias in its epilogue, in fp32 after the scales and before the one
#     rounding to the output dtype; the CUDA kernels take it only as a 16-bit bias for a 16-bit
#     output of the same dtype. Then the bias costs no pass of its own (a separate broadcast add
#     re-reads and re-writes the whole output). Any other combination (an fp32 output, a bias of
#     another dtype) adds it to the fp32 accumulator's result the same way where the output is
#     fp32 (one rounding), else after. Every path (scaled_mm, padded, emulated) follows this rule,
#     so CPU and GPU round alike.
_EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)


def _bias_in_epilogue(bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    return bias is not None and out_dtype in _EPILOGUE_DTYPES and bias.dtype == out_dtype


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    if _bias_in_epilogue(bias, out_dtype):
        return torch._scaled_mm(a, b, scale_a=a_scale_inv, scale_b=b_scale_inv, bias=bias,
                                out_dtype=out_dtype)
    out = torch._scaled_mm(a, b, scale_a=a_scale_inv, scale_b=b_scale_inv, out_dtype=out_dtype)
    return out if bias is None else out + bias.to(out_dtype)


def _emulated_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                 b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    # The FP8 values are exact in fp32; the product is taken in fp32, then scaled once.
    out = torch.mm(a.float(), b.float()) * (a_scale_inv.float() * b_scale_inv.float())
    if _bias_in_epilogue(bias, out_dtype):
        out = out + bias.float()  # type: ignore[union-attr]
    elif bias is not None:
        return out.to(out_dtype) + bias.to(out_dtype)
    return out.to(out_dtype)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D FP8 tensor to ``[rows, cols]``, going through uint8 (pad has no float8)."""
    pad_r, pad_c = rows - x.shape[0], cols - x.shape[1]
    if pad_r == 0 and pad_c == 0:
        return x
    # The float8 zero is the all-zero byte in both formats.
    return F.pad(x.view(torch.uint8), (0, pad_c, 0, pad_r)).view(x.dtype)


def _padded_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
               b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    mp, kp, np_ = (-(-d // _ALIGN) * _ALIGN for d in (m, k, n))
    a_p = _pad_to(a, mp, kp).contiguous()  # [mp, kp] row-major
    b_p = _pad_to(b.t(), np_, kp).contiguous().t()  # [kp, np] column-major
    bias_p = None if bias is None else F.pad(bias, (0, np_ - n))  # zero columns are sliced off
    return _scaled_mm(a_p, b_p, a_scale_inv, b_scale_inv, out_dtype, bias_p)[:m, :n]

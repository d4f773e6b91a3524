"""The fused FP8 casts: one entry point per scaling mode, a Triton path and a reference path.

[Note: fused cast]
    ``quantize_current`` (current scaling: amax -> scale -> cast) and ``quantize_with_scale``
    (delayed scaling: cast with a given scale, fold amax(x) into ``amax_out``) return an
    ``Fp8Cast(data, data_t, scale_inv, amax)``; with ``transpose=True`` ``data_t`` holds the
    row-major bytes of xᵀ (what the backward GEMMs want), made in the same pass.

    The reference path is the eager code (``amax``, ``scale_from_amax``, ``cast_to_fp8``,
    ``.t().contiguous()``) and is the specification. The Triton path (``triton_cast``: two
    launches for current scaling, one for delayed) serves a call when ``use_triton`` allows it
    (CUDA, not compiling, ``fp8shard.get_triton()``; see ``fp8shard._triton``) and the tensors
    suit it (contiguous bf16/fp16/fp32 x, fp32 one-element scales on x's device); its results
    are bit-identical: FP8 bytes, ``scale_inv`` and amax (NaN compares as NaN).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch

from fp8shard._triton import use_triton

# The eager path is quantizer's encoding and scale rule, and quantizer's per-tensor casts are
# these: each module reads the other through a module reference, when called, so either may be
# imported first.
from fp8shard.fp8 import quantizer as _q
from fp8shard.fp8.formats import Fp8Format

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# How many calls the Triton path served, by function name (tests check the path taken).
triton_calls: collections.Counter[str] = collections.Counter()


class Fp8Cast(NamedTuple):
    """What a fused cast returns. ``data`` has x's shape (or is ``out``); ``scale_inv`` is 0-d."""

    data: torch.Tensor
    """FP8 bytes of x (``fmt.torch_dtype``; ``out`` itself when given)."""
    data_t: torch.Tensor | None
    """``transpose=True``: contiguous FP8 bytes of ``x.t()`` ([K, M]); else None."""
    scale_inv: torch.Tensor
    """0-d ``1 / scale`` (fp32 for fp32 scales)."""
    amax: torch.Tensor | None
    """Current scaling: fp32 0-d amax(x). Delayed: ``amax_out`` (None if not given)."""


# ------------------------------------------------------------------------------ public dispatch
def quantize_current(x: torch.Tensor, fmt: Fp8Format | str, *, transpose: bool = False,
                     prev_scale_inv: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> Fp8Cast:
    """Current scaling: ``scale = scale_from_amax(amax(x), fmt.max, prev)``, then the cast.

    ``prev_scale_inv``: the inverse of the scale to keep when amax is zero or non-finite
    (default: scale 1). ``out``: write the bytes there (x's shape, float8 of ``fmt`` or uint8).
    ``transpose=True`` needs a 2-D x.
    """
    fmt = Fp8Format.parse(fmt)
    _check_transpose(x, transpose)
    if _triton_serves(x, transpose, out, fmt, prev_scale_inv):
        triton_calls["quantize_current"] += 1
        return _triton_cast(x, fmt, transpose, out, prev_scale_inv=prev_scale_inv)
    return reference_quantize_current(x, fmt, transpose=transpose, prev_scale_inv=prev_scale_inv,
                                      out=out)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format | str, *,
                        transpose: bool = False, amax_out: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> Fp8Cast:
    """Cast with a given one-element ``scale`` (delayed scaling), in one pass over x.

    ``amax_out`` (fp32, one element): updated in place to ``max(amax_out, amax(x))``, NaN
    propagating (it must hold an amax, i.e. >= 0 or NaN, as an amax history does).
    """
    fmt = Fp8Format.parse(fmt)
    _check_transpose(x, transpose)
    if _triton_serves(x, transpose, out, fmt, scale, amax_out):
        triton_calls["quantize_with_scale"] += 1
        return _triton_cast(x, fmt, transpose, out, scale=scale, amax_out=amax_out)
    return reference_quantize_with_scale(x, scale, fmt, transpose=transpose, amax_out=amax_out,
                                         out=out)


# ------------------------------------------------------------------------------ reference path
def reference_quantize_current(x: torch.Tensor, fmt: Fp8Format | str, *, transpose: bool = False,
                               prev_scale_inv: torch.Tensor | None = None,
                               out: torch.Tensor | None = None) -> Fp8Cast:
    """The eager specification of :func:`quantize_current` (what CPU and compile run)."""
    fmt = Fp8Format.parse(fmt)
    _check_transpose(x, transpose)
    x = x.detach()
    a = _q.amax(x)
    prev = None if prev_scale_inv is None else prev_scale_inv.reciprocal()
    scale = _q.scale_from_amax(a, fmt.max, prev)
    data = _q.cast_to_fp8(x, scale, fmt, out=out)
    return Fp8Cast(data, data.t().contiguous() if transpose else None,
                   scale.reshape(()).reciprocal(), a)


def reference_quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format | str, *,
                                  transpose: bool = False, amax_out: torch.Tensor | None = None,
                                  out: torch.Tensor | None = None) -> Fp8Cast:
    """The eager specification of :func:`quantize_with_scale`."""
    fmt = Fp8Format.parse(fmt)
    _check_transpose(x, transpose)
    x = x.detach()
    if amax_out is not None:
        amax_out.copy_(torch.maximum(amax_out, _q.amax(x)))
    data = _q.cast_to_fp8(x, scale, fmt, out=out)
    return Fp8Cast(data, data.t().contiguous() if transpose else None,
                   scale.reshape(()).reciprocal(), amax_out)


# ------------------------------------------------------------------------------ Triton path
def _check_transpose(x: torch.Tensor, transpose: bool) -> None:
    if transpose and x.dim() != 2:
        raise ValueError(f"transpose=True needs a 2-D tensor, got shape {tuple(x.shape)}")


def _triton_serves(x: torch.Tensor, transpose: bool, out: torch.Tensor | None, fmt: Fp8Format,
                   *scalars: torch.Tensor | None) -> bool:
    """Whether the Triton path takes this call (else the reference path, same results)."""
    if not use_triton(x):  # CUDA, not compiling, fp8shard.get_triton()
        return False
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.dtype not in TRITON_DTYPES:
        return False
    if x.numel() == 0 or not x.is_contiguous():
        return False
    dev = x.device
    for s in scalars:  # scales and amaxes: fp32, one element, on x's device
        if s is not None and not (s.dtype == torch.float32 and s.numel() == 1 and s.device == dev):
            return False
    if transpose:
        from fp8shard.fp8.triton_cast import MAX_TILED_DIM

        if max(x.shape) >= MAX_TILED_DIM:
            return False
    if out is not None:
        if out.shape != x.shape or not out.is_contiguous() or out.device != x.device:
            return False
        if out.dtype not in (fmt.torch_dtype, torch.uint8):
            return False
    return True


def _triton_cast(x: torch.Tensor, fmt: Fp8Format, transpose: bool, out: torch.Tensor | None, *,
                 scale: torch.Tensor | None = None, prev_scale_inv: torch.Tensor | None = None,
                 amax_out: torch.Tensor | None = None) -> Fp8Cast:
    from fp8shard.fp8 import triton_cast

    dev = x.device
    data = out if out is not None else torch.empty(x.shape, dtype=fmt.torch_dtype, device=dev)
    data_t = torch.empty((x.shape[1], x.shape[0]), dtype=fmt.torch_dtype, device=dev) if transpose else None
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    amax = torch.empty((), dtype=torch.float32, device=dev) if scale is None else amax_out
    triton_cast.launch_cast(
        x, fmt, data.view(torch.uint8), None if data_t is None else data_t.view(torch.uint8),
        scale_inv, scale=scale, prev_scale_inv=prev_scale_inv,
        amax=amax if scale is None else None, amax_out=amax_out,
    )
    return Fp8Cast(data, data_t, scale_inv, amax)

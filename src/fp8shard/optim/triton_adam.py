"""Triton kernels of the fused optimizer step: [Note: fused step] in fused_step.py.

Imported only when ``fp8shard._triton.use_triton`` says Triton serves the call; importing it
without Triton installed works too (the kernels are then simply not defined).

Kernel 1 (``_adam_kernel``) and kernel 2 (``_cast_kernel``) run one program per tile of a
``TileTable``. A full tile (``numel == BLOCK``) takes the unmasked, vectorizable path; the last
tile of a piece takes the masked one. Offsets are int64. Arithmetic follows ``fused_step.adam_``'s
reference formulas as PyTorch's CUDA foreach kernels evaluate them, op by op in fp32:

    AdamW:  p = p * (1 - lr*wd)                      Adam + L2:  g = fma(wd, p, g)
    m = fma(w, g - m, m)              (torch.lerp, w = 1 - beta1 < 0.5; else g - (g - m) * (1 - w))
    v = fma(1 - beta2, g * g, v * beta2)                        (addcmul: fma(value, g*g, v))
    denom = div_rn(sqrt_rn(v), sqrt(1 - beta2**t)) + eps
    p = fma(-lr / (1 - beta1**t), div_rn(m, denom), p)          (addcdiv: fma(value, m/denom, p))

with contraction off (``enable_fp_fusion=False``), so the only fused multiply-adds are these.
The FP8 encoding is c10's ``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value`` written in
integer ops (round to nearest even; NaN keeps its sign bit), applied after the clamp to +-max,
so the bytes equal ``cast_to_fp8``'s by construction, independent of the hardware's cvt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fp8shard.fp8 import Fp8Format

if TYPE_CHECKING:
    from fp8shard.optim.fused_step import AdamScalars, TileTable

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # not installed, or broken: the caller uses the reference path
    HAVE_TRITON = False

# Kernel 1 with 2048-element tiles: 16 warps (4 elements per thread) measured 1.82 ms at 256 M
# parameters against 2.05 ms with 8 (benchmarks/bench_fused_step.py --sweep on the H200).
ADAM_NUM_WARPS = 16
NUM_WARPS = 8

_FMT_CODE = {Fp8Format.E4M3: 0, Fp8Format.E5M2: 1}


if HAVE_TRITON:

    @triton.jit
    def _fp8_code(y, FMT: tl.constexpr):
        """The FP8 byte (as int32 0..255) of fp32 ``y``, already clamped to +-max.

        c10's conversion: values below the smallest normal go through an fp32 add that rounds
        to the subnormal grid; others get the exponent rebased and a round-to-nearest-even bias.
        """
        bits = y.to(tl.int32, bitcast=True)
        neg = bits < 0
        a = bits & 0x7FFFFFFF
        if FMT == 0:  # E4M3FN: bias 7, 3 mantissa bits, max 448, NaN 0x7F
            den = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
            nrm = (a + (0x7FFFF - (120 << 23)) + ((a >> 20) & 1)) >> 20
            code = tl.where(a < (121 << 23), den, nrm)
            code = tl.where(a >= (1087 << 20), 0x7F, code)
        else:  # E5M2: bias 15, 2 mantissa bits, max 57344, NaN 0x7F
            den = (a.to(tl.float32, bitcast=True) + 128.0).to(tl.int32, bitcast=True) - (134 << 23)
            nrm = (a + (0xFFFFF - (112 << 23)) + ((a >> 21) & 1)) >> 21
            code = tl.where(a < (113 << 23), den, nrm)
            code = tl.where(a >= (143 << 23), tl.where(a > (255 << 23), 0x7F, 0x7C), code)
        return tl.where(neg, code | 0x80, code)

    @triton.jit
    def _saturate(y, fmt_max):
        """clamp(y, -max, max) keeping NaN (tl.minimum/maximum would drop it)."""
        y = tl.where(y > fmt_max, fmt_max, y)
        return tl.where(y < -fmt_max, -fmt_max, y)

    @triton.jit
    def _max_keep_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _adam_body(tile, n, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, out_ptr,
                   local_ptr, param_ptr, slot_ptr, scale_ptr, grad_scale_ptr,
                   decay, weight_decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
                   fmt_max,
                   BLOCK: tl.constexpr, ALIGN: tl.constexpr, WD_MODE: tl.constexpr,
                   LERP_SMALL: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, OUT_MODE: tl.constexpr,
                   FMT: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        lo = tl.multiple_of(tl.load(local_ptr + tile), ALIGN) + offs  # int64
        po = tl.multiple_of(tl.load(param_ptr + tile), ALIGN) + offs
        p = tl.load(master_ptr + lo, mask=mask, other=0.0)
        m = tl.load(exp_avg_ptr + lo, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + lo, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + po, mask=mask, other=0.0).to(tl.float32)
        if HAS_GRAD_SCALE:
            g = g * tl.load(grad_scale_ptr)
        if WD_MODE == 1:  # AdamW: p *= 1 - lr * wd
            p = p * decay
        elif WD_MODE == 2:  # Adam + L2: g = g + wd * p
            g = tl.fma(p, weight_decay, g)
        if LERP_SMALL:  # m.lerp_(g, w)
            m = tl.fma(g - m, lerp_w, m)
        else:
            m = tl.fma(-(g - m), 1.0 - lerp_w, g)
        v = tl.fma(g * g, one_minus_beta2, v * beta2)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = tl.fma(tl.div_rn(m, denom), neg_step_size, p)
        tl.store(master_ptr + lo, p, mask=mask)
        tl.store(exp_avg_ptr + lo, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + lo, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
        if OUT_MODE == 2:  # delayed scaling: the scale is known, cast in the same pass
            s = tl.load(scale_ptr + tl.load(slot_ptr + tile))
            code = _fp8_code(_saturate(p * s, fmt_max), FMT)
            tl.store(out_ptr + po, code.to(tl.uint8), mask=mask)
        elif OUT_MODE == 3:  # non-FP8 region: the parameter in its dtype (round to nearest even)
            tl.store(out_ptr + po, p.to(out_ptr.dtype.element_ty), mask=mask)
        # The tile's amax of the new master; NaN if it holds one (as the inf-norm gives it).
        return tl.reduce(tl.where(mask, tl.abs(p), 0.0), 0, _max_keep_nan)

    @triton.jit(do_not_specialize=["tile_base"])
    def _adam_kernel(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, out_ptr,
                     local_ptr, param_ptr, numel_ptr, slot_ptr, scale_ptr, partial_ptr, grad_scale_ptr,
                     apply_ptr, tile_base,
                     decay, weight_decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
                     fmt_max,
                     BLOCK: tl.constexpr, ALIGN: tl.constexpr, WD_MODE: tl.constexpr,
                     LERP_SMALL: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, OUT_MODE: tl.constexpr,
                     FMT: tl.constexpr, HAS_APPLY: tl.constexpr):
        go = True
        if HAS_APPLY:  # the step's skip decision, read here: nothing is written when it is 0
            go = tl.load(apply_ptr) != 0
        if go:
            tile = tl.program_id(0) + tile_base
            n = tl.load(numel_ptr + tile)
            if n == BLOCK:  # a full tile: no mask (constant), vector loads and stores
                amax = _adam_body(tile, BLOCK, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, out_ptr,
                                  local_ptr, param_ptr, slot_ptr, scale_ptr, grad_scale_ptr,
                                  decay, weight_decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps,
                                  neg_step_size, fmt_max, BLOCK, ALIGN, WD_MODE, LERP_SMALL,
                                  HAS_GRAD_SCALE, OUT_MODE, FMT)
            else:
                amax = _adam_body(tile, n, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, out_ptr,
                                  local_ptr, param_ptr, slot_ptr, scale_ptr, grad_scale_ptr,
                                  decay, weight_decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps,
                                  neg_step_size, fmt_max, BLOCK, ALIGN, WD_MODE, LERP_SMALL,
                                  HAS_GRAD_SCALE, OUT_MODE, FMT)
            if OUT_MODE == 1 or OUT_MODE == 2:
                tl.store(partial_ptr + tile, amax)

    @triton.jit
    def _cast_body(tile, n, master_ptr, out_ptr, local_ptr, param_ptr, slot_ptr, scale_ptr, fmt_max,
                   BLOCK: tl.constexpr, ALIGN: tl.constexpr, FMT: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        lo = tl.multiple_of(tl.load(local_ptr + tile), ALIGN) + offs
        po = tl.multiple_of(tl.load(param_ptr + tile), ALIGN) + offs
        x = tl.load(master_ptr + lo, mask=mask, other=0.0)
        s = tl.load(scale_ptr + tl.load(slot_ptr + tile))
        code = _fp8_code(_saturate(x * s, fmt_max), FMT)
        tl.store(out_ptr + po, code.to(tl.uint8), mask=mask)

    @triton.jit(do_not_specialize=["tile_base"])
    def _cast_kernel(master_ptr, out_ptr, local_ptr, param_ptr, numel_ptr, slot_ptr, scale_ptr,
                     apply_ptr, tile_base, fmt_max,
                     BLOCK: tl.constexpr, ALIGN: tl.constexpr, FMT: tl.constexpr, HAS_APPLY: tl.constexpr):
        go = True
        if HAS_APPLY:
            go = tl.load(apply_ptr) != 0
        if go:
            tile = tl.program_id(0) + tile_base
            n = tl.load(numel_ptr + tile)
            if n == BLOCK:
                _cast_body(tile, BLOCK, master_ptr, out_ptr, local_ptr, param_ptr, slot_ptr, scale_ptr,
                           fmt_max, BLOCK, ALIGN, FMT)
            else:
                _cast_body(tile, n, master_ptr, out_ptr, local_ptr, param_ptr, slot_ptr, scale_ptr,
                           fmt_max, BLOCK, ALIGN, FMT)


def _flag(apply: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """The skip flag as the kernels read it (one byte: 1 applies the step), or any pointer."""
    if apply is None:
        return dummy
    if apply.dtype != torch.bool or apply.numel() != 1 or apply.device != dummy.device:
        raise ValueError("apply must be a one-element bool tensor on the kernels' device")
    return apply.reshape(1).view(torch.uint8)


def _check(master: torch.Tensor, *tensors: torch.Tensor) -> None:
    for t in (master, *tensors):
        if not t.is_contiguous() or t.device != master.device:
            raise ValueError("the fused kernels take contiguous tensors on one device")


def launch_adam(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                grad: torch.Tensor, out: torch.Tensor, table: TileTable, t0: int, t1: int,
                hp: AdamScalars, *, out_mode: int, fmt: Fp8Format | None,
                grad_scale: torch.Tensor | None, scale: torch.Tensor | None,
                partial_amax: torch.Tensor | None, apply: torch.Tensor | None = None,
                num_warps: int = ADAM_NUM_WARPS) -> None:
    """Kernel 1 on tiles ``[t0, t1)`` of ``table`` (all of one param group, hyperparameters ``hp``).

    ``out`` is the region's parameter buffer (uint8 for FP8), ``grad`` its gradient buffer.
    ``apply``: a 0-d bool on the device; where False every program returns before writing.
    """
    if not HAVE_TRITON:
        raise RuntimeError("triton is not available")
    if t1 <= t0:
        return
    _check(master, exp_avg, exp_avg_sq, grad, out)
    if master.dtype != torch.float32:
        raise ValueError(f"the master must be fp32, got {master.dtype}")
    fp8 = out_mode in (1, 2)
    dummy = master
    _adam_kernel[(t1 - t0,)](
        master, exp_avg, exp_avg_sq, grad, out,
        table.local_start, table.param_start, table.numel, table.slot,
        scale if scale is not None else dummy,
        partial_amax if partial_amax is not None else dummy,
        grad_scale if grad_scale is not None else dummy,
        _flag(apply, dummy), t0, **hp.kernel_args(), fmt_max=float(fmt.max) if fmt is not None else 0.0,
        BLOCK=table.block, ALIGN=table.align, WD_MODE=hp.wd_mode, LERP_SMALL=hp.lerp_small,
        HAS_GRAD_SCALE=grad_scale is not None, OUT_MODE=out_mode,
        FMT=_FMT_CODE[fmt] if fp8 and fmt is not None else 0, HAS_APPLY=apply is not None,
        num_warps=num_warps, enable_fp_fusion=False,
    )


def launch_cast(master: torch.Tensor, out: torch.Tensor, table: TileTable, scale: torch.Tensor,
                fmt: Fp8Format, apply: torch.Tensor | None = None, num_warps: int = NUM_WARPS) -> None:
    """Kernel 2 on every tile of ``table``: ``out`` (uint8) from ``master`` with ``scale[slot]``;
    nothing where the 0-d bool ``apply`` is False."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not available")
    if table.num_tiles == 0:
        return
    _check(master, out, scale)
    _cast_kernel[(table.num_tiles,)](
        master, out, table.local_start, table.param_start, table.numel, table.slot, scale,
        _flag(apply, scale), 0, float(fmt.max), BLOCK=table.block, ALIGN=table.align, FMT=_FMT_CODE[fmt],
        HAS_APPLY=apply is not None, num_warps=num_warps, enable_fp_fusion=False,
    )

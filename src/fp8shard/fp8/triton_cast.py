"""Triton kernels of the fused FP8 casts ([Note: fused cast] in ``fp8shard.fp8.fused``).

Imported only by ``fp8shard.fp8.fused`` when ``fp8shard._triton.use_triton`` says a call runs
on the GPU; the module still imports without Triton (its kernels then cannot be launched).

Three kernels, each bit-exact with the PyTorch reference path of ``fused``:

* ``_amax_kernel``: pass 1 of current scaling. A persistent grid; each program keeps a running
  max of ``bits(|x|)`` and writes one int32 partial. The max is taken on the int32 bits of the
  fp32 value with the sign bit cleared: for non-negative floats that order is the float order,
  and every NaN lies above +inf, so a NaN anywhere makes the amax NaN, as ``torch.max`` does.
* ``_cast_kernel`` (flat) and ``_cast_t_kernel`` (2-D tiles that also write the row-major bytes
  of xᵀ): pass 2. Current scaling: every program reduces the partials itself (a few KB from
  L2), computes the scale with ``scale_from_amax``'s arithmetic and guards, and program 0
  writes amax and ``scale_inv``. Delayed scaling: the scale is read from memory and the amax of
  x is folded into ``amax_out`` with one int32 ``atomic_max`` per program (same bit trick).
  Programs walk the blocks in the reverse order of pass 1, so the tail of x that pass 1 read
  last is still in L2 when pass 2 starts.

Arithmetic, chosen to give the reference's bits (docs/fp8.md, "Fused Triton casts"):
``scale = rcp(amax) * fmt.max`` (``fmt.max / amax`` on a tensor is ``amax.reciprocal() *
fmt.max`` in PyTorch) with IEEE division (``div_rn``, never the approximate ``/``);
``y = x_fp32 * scale``; clamp by compare-and-select (NaN stays NaN); the hardware's
round-to-nearest-even fp32 -> fp8 conversion; NaN bytes are then set to ``sign | 0x7F`` as
PyTorch's conversion does. bf16 is widened by a 16-bit shift, as PyTorch does.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from fp8shard.fp8.formats import Fp8Format

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # no Triton: the module imports, its kernels cannot run
    triton = tl = None

    def _jit(fn):
        return fn


# Tuning (benchmarks/profile_cast.py --sweep times alternatives): elements per block of the
# flat kernels, tile of the transposing kernel, warps per program. Grids are persistent: as many
# programs as fit on the GPU at once (from the compiled kernel's registers and shared memory),
# so no program waits for a second wave.
AMAX_BLOCK, AMAX_WARPS = 4096, 4
CAST_BLOCK, CAST_WARPS = 4096, 4
TILE_M, TILE_K, TILE_WARPS = 64, 64, 4
MAX_TILED_DIM = 1 << 24  # in-tile offsets of the transposing kernel are int32: dim * tile < 2**31
# The cast kernels load all pass-1 partials at once: at most this many (a power of two).
_MAX_PARTIALS = 1024
_MAX_PROGRAMS_PER_SM = 16
# NaN bytes set to PyTorch's (sign | 0x7F) explicitly. False drops that fix-up (10% faster on the
# H200, whose multiply returns the canonical positive NaN, so the bytes still matched there).
_NAN_FIX = True


# ---------------------------------------------------------------------------------- device code
@_jit
def _widen(x, IN_BF16: tl.constexpr):
    """x as fp32. bf16: the 16-bit shift PyTorch uses (NaN payload and sign kept)."""
    if IN_BF16:
        xf = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        xf = x.to(tl.float32)
    return xf


@_jit
def _abs_bits(xf):
    """int32 bits of |xf|: ordered like |xf|, every NaN above +inf."""
    return xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@_jit
def _fp8_bits(xf, scale, FMAX: tl.constexpr, IS_E4M3: tl.constexpr, NAN_FIX: tl.constexpr = True):
    """uint8 bytes of saturate(round(xf * scale)), exactly as ``cast_to_fp8``."""
    y = xf * scale
    ybits = y.to(tl.uint32, bitcast=True)
    is_nan = y != y
    y = tl.where(y > FMAX, FMAX, y)  # compare-and-select: NaN passes through
    y = tl.where(y < -FMAX, -FMAX, y)
    if IS_E4M3:
        q = y.to(tl.float8e4nv)  # cvt.rn.satfinite: round to nearest even
    else:
        q = y.to(tl.float8e5)
    bits = q.to(tl.uint8, bitcast=True).to(tl.uint32)
    if NAN_FIX:
        nan_bits = ((ybits >> 24) & 0x80) | 0x7F  # PyTorch: NaN -> 0x7F with the sign of y
        bits = tl.where(is_nan, nan_bits, bits)
    return bits.to(tl.uint8)


@_jit
def _current_scale(part_ptr, n_part, prev_ptr, HAS_PREV: tl.constexpr, FMAX: tl.constexpr,
                   P2: tl.constexpr):
    """(amax, scale) from the pass-1 partials, as ``scale_from_amax(amax, FMAX, prev)``."""
    offs = tl.arange(0, P2)
    part = tl.load(part_ptr + offs, mask=offs < n_part, other=0)
    amax = tl.max(part, axis=0).to(tl.float32, bitcast=True)
    s = tl.math.div_rn(1.0, amax) * FMAX  # PyTorch: fmt_max / amax == amax.reciprocal() * fmt_max
    # isfinite(amax) & amax > 0 & isfinite(s) & s > 0; NaN fails every comparison.
    ok = (amax > 0.0) & (amax <= 3.4028234663852886e38) & (s > 0.0) & (s <= 3.4028234663852886e38)
    if HAS_PREV:
        prev = tl.math.div_rn(1.0, tl.load(prev_ptr))  # prev_scale = prev_scale_inv.reciprocal()
    else:
        prev = 1.0
    return amax, tl.where(ok, s, prev)


@_jit
def _cast_scale(pid, scale_ptr, prev_ptr, part_ptr, n_part, scale_inv_ptr, amax_ptr,
                CURRENT: tl.constexpr, HAS_PREV: tl.constexpr, FMAX: tl.constexpr, P2: tl.constexpr):
    """The scale a cast program uses: from the pass-1 partials (current scaling) or read from
    memory (delayed); program 0 writes the amax (current) and ``scale_inv``."""
    if CURRENT:
        amax, scale = _current_scale(part_ptr, n_part, prev_ptr, HAS_PREV, FMAX, P2)
        if pid == 0:
            tl.store(amax_ptr, amax)
    else:
        scale = tl.load(scale_ptr)
    if pid == 0:
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
    return scale


@_jit
def _amax_kernel(x_ptr, part_ptr, n, nblocks, IN_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for blk in range(pid, nblocks, nprog):
        start = tl.cast(blk, tl.int64) * BLOCK
        if start + BLOCK <= n:
            x = tl.load(x_ptr + start + offs)
        else:
            x = tl.load(x_ptr + start + offs, mask=offs < n - start, other=0.0)
        acc = tl.maximum(acc, _abs_bits(_widen(x, IN_BF16)))
    tl.store(part_ptr + pid, tl.max(acc, axis=0))


@_jit
def _cast_kernel(x_ptr, out_ptr, n, nblocks, scale_ptr, prev_ptr, part_ptr, n_part, scale_inv_ptr,
                 amax_ptr, amax_acc_ptr,
                 CURRENT: tl.constexpr, HAS_PREV: tl.constexpr, ACC_AMAX: tl.constexpr,
                 IN_BF16: tl.constexpr, IS_E4M3: tl.constexpr, FMAX: tl.constexpr,
                 BLOCK: tl.constexpr, P2: tl.constexpr, NAN_FIX: tl.constexpr = True):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    scale = _cast_scale(pid, scale_ptr, prev_ptr, part_ptr, n_part, scale_inv_ptr, amax_ptr,
                        CURRENT, HAS_PREV, FMAX, P2)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([], dtype=tl.int32)  # a scalar: a block-sized one costs registers
    for i in range(pid, nblocks, nprog):
        start = tl.cast(nblocks - 1 - i, tl.int64) * BLOCK  # reverse order: pass 1's tail is in L2
        if start + BLOCK <= n:
            xf = _widen(tl.load(x_ptr + start + offs, eviction_policy="evict_first"), IN_BF16)
            tl.store(out_ptr + start + offs, _fp8_bits(xf, scale, FMAX, IS_E4M3, NAN_FIX))
        else:
            mask = offs < n - start
            xf = _widen(tl.load(x_ptr + start + offs, mask=mask, other=0.0), IN_BF16)
            tl.store(out_ptr + start + offs, _fp8_bits(xf, scale, FMAX, IS_E4M3, NAN_FIX), mask=mask)
        if ACC_AMAX:
            acc = tl.maximum(acc, tl.max(_abs_bits(xf), axis=0))
    if ACC_AMAX:
        tl.atomic_max(amax_acc_ptr, acc, sem="relaxed")


@_jit
def _cast_t_kernel(x_ptr, out_ptr, out_t_ptr, M, K, tiles_k, ntiles, scale_ptr, prev_ptr, part_ptr, n_part,
                   scale_inv_ptr, amax_ptr, amax_acc_ptr,
                   CURRENT: tl.constexpr, HAS_PREV: tl.constexpr, ACC_AMAX: tl.constexpr,
                   IN_BF16: tl.constexpr, IS_E4M3: tl.constexpr, FMAX: tl.constexpr,
                   BM: tl.constexpr, BK: tl.constexpr, P2: tl.constexpr, NAN_FIX: tl.constexpr = True):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    scale = _cast_scale(pid, scale_ptr, prev_ptr, part_ptr, n_part, scale_inv_ptr, amax_ptr,
                        CURRENT, HAS_PREV, FMAX, P2)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    offs = rm[:, None] * K + rk[None, :]  # [BM, BK] in x and out (int32: BM * K < 2**31)
    offs_t = rk[:, None] * M + rm[None, :]  # [BK, BM] in out_t (int32: BK * M < 2**31)
    acc = tl.zeros([], dtype=tl.int32)
    for i in range(pid, ntiles, nprog):
        t = ntiles - 1 - i  # reverse order: pass 1's tail is in L2
        m0 = tl.cast(t // tiles_k, tl.int64) * BM
        k0 = tl.cast(t % tiles_k, tl.int64) * BK
        base = m0 * K + k0
        base_t = k0 * M + m0
        # One masked path: with M and K multiples of 16 the masks are constant over 16-byte
        # vectors, so loads and stores stay vectorized.
        mask = (rm[:, None] < M - m0) & (rk[None, :] < K - k0)
        mask_t = (rk[:, None] < K - k0) & (rm[None, :] < M - m0)
        xf = _widen(tl.load(x_ptr + base + offs, mask=mask, other=0.0, eviction_policy="evict_first"),
                    IN_BF16)
        q = _fp8_bits(xf, scale, FMAX, IS_E4M3, NAN_FIX)
        tl.store(out_ptr + base + offs, q, mask=mask)
        tl.store(out_t_ptr + base_t + offs_t, tl.trans(q), mask=mask_t)
        if ACC_AMAX:
            acc = tl.maximum(acc, tl.max(tl.max(_abs_bits(xf), axis=1), axis=0))
    if ACC_AMAX:
        tl.atomic_max(amax_acc_ptr, acc, sem="relaxed")


# ---------------------------------------------------------------------------------- host code
@functools.cache
def _device_limits(device_index: int) -> tuple[int, int, int, int]:
    """SMs, and per SM: registers, threads, shared memory bytes."""
    p = torch.cuda.get_device_properties(device_index)
    return (p.multi_processor_count, getattr(p, "regs_per_multiprocessor", 65536),
            getattr(p, "max_threads_per_multi_processor", 2048),
            getattr(p, "shared_memory_per_multiprocessor", 228 * 1024))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fit(compiled, num_warps: int, device_index: int) -> int:
    """Programs per SM of a compiled kernel, limited by registers, threads and shared memory."""
    _, regs_sm, threads_sm, smem_sm = _device_limits(device_index)
    threads = num_warps * 32
    regs = max(8, -(-int(compiled.n_regs) // 8) * 8)  # allocated in units of 8 per thread
    smem = int(compiled.metadata.shared)
    fit = min(regs_sm // (regs * threads), threads_sm // threads, _MAX_PROGRAMS_PER_SM)
    if smem:
        fit = min(fit, smem_sm // (smem + 1024))  # 1 KB per block is reserved
    return max(1, fit)


class _Plan:
    """What a call does, from its shapes and flags alone; cached per such key in ``_plans``.

    Grids are persistent. A new plan launches one program per SM and records from the compiled
    kernels how many fit (``fitted``); the plan made next for the key uses that many.
    """

    def __init__(self, x: torch.Tensor, fmt: Fp8Format, current: bool, has_prev: bool,
                 acc_amax: bool, transpose: bool, fit: tuple[int, int] | None) -> None:
        self.index = x.device.index
        sms = _device_limits(self.index)[0]
        amax_fit, cast_fit = fit or (1, 1)
        self.fitted = fit is not None
        n = x.numel()
        in_bf16 = x.dtype == torch.bfloat16
        self.current = current
        n_part = 1
        if current:
            amax_blocks = _cdiv(n, AMAX_BLOCK)
            n_part = min(amax_blocks, sms * amax_fit, _MAX_PARTIALS)
            self.amax_grid = (n_part,)
            self.amax_ints = (n, amax_blocks)
            self.amax_kw = dict(IN_BF16=in_bf16, BLOCK=AMAX_BLOCK, num_warps=AMAX_WARPS)
        self.n_part = n_part
        self.cast_kw = dict(CURRENT=current, HAS_PREV=has_prev, ACC_AMAX=acc_amax, IN_BF16=in_bf16,
                            IS_E4M3=fmt is Fp8Format.E4M3, FMAX=float(fmt.max),
                            P2=max(16, 1 << (n_part - 1).bit_length()), NAN_FIX=_NAN_FIX)
        if transpose:
            m, k = x.shape
            tiles_k = _cdiv(k, TILE_K)
            work = _cdiv(m, TILE_M) * tiles_k
            self.cast_kernel = _cast_t_kernel
            self.cast_ints = (m, k, tiles_k, work)
            self.cast_kw.update(BM=TILE_M, BK=TILE_K, num_warps=TILE_WARPS)
        else:
            work = _cdiv(n, CAST_BLOCK)
            self.cast_kernel = _cast_kernel
            self.cast_ints = (n, work)
            self.cast_kw.update(BLOCK=CAST_BLOCK, num_warps=CAST_WARPS)
        self.cast_grid = (min(work, sms * cast_fit),)


_plans: dict[tuple, _Plan] = {}


def launch_cast(x: torch.Tensor, fmt: Fp8Format, data: torch.Tensor, data_t: torch.Tensor | None,
                scale_inv: torch.Tensor, *, scale: torch.Tensor | None = None,
                prev_scale_inv: torch.Tensor | None = None, amax: torch.Tensor | None = None,
                amax_out: torch.Tensor | None = None) -> None:
    """Current scaling when ``scale`` is None (then ``amax`` receives the amax), else delayed.

    ``data``/``data_t`` are uint8 views of the outputs; every tensor is on ``x``'s device and
    checked by ``fused`` (contiguous x of bf16/fp16/fp32, fp32 one-element scales).
    """
    if triton is None:
        raise RuntimeError("fp8shard.fp8.triton_cast needs Triton; use the reference path")
    current, transpose = scale is None, data_t is not None
    has_prev, acc_amax = prev_scale_inv is not None, amax_out is not None
    key = (x.shape, x.dtype, x.device, fmt, current, has_prev, acc_amax, transpose)
    plan = _plans.get(key)
    if plan is None or not plan.fitted:
        if len(_plans) > 4096:
            _plans.clear()
        plan = _plans[key] = _Plan(x, fmt, current, has_prev, acc_amax, transpose, None)
    # Triton launches on the current device: switch only when x lives elsewhere.
    on_device = torch.cuda.current_device() == plan.index
    with contextlib.nullcontext() if on_device else torch.cuda.device(plan.index):
        amax_compiled = None
        if current:
            partials = torch.empty(plan.n_part, dtype=torch.int32, device=x.device)
            amax_compiled = _amax_kernel[plan.amax_grid](x, partials, *plan.amax_ints, **plan.amax_kw)
        else:
            partials = scale_inv
        # Unused pointer arguments get any tensor of this call: the constexpr flags keep the
        # kernels from touching them.
        ptrs = (scale if scale is not None else scale_inv,
                prev_scale_inv if has_prev else scale_inv,
                partials, plan.n_part, scale_inv,
                amax if amax is not None else scale_inv,
                amax_out.view(torch.int32) if acc_amax else partials)
        outs = (data, data_t) if transpose else (data,)
        cast_compiled = plan.cast_kernel[plan.cast_grid](x, *outs, *plan.cast_ints, *ptrs, **plan.cast_kw)
    if not plan.fitted:
        fit = (_fit(amax_compiled, AMAX_WARPS, plan.index) if amax_compiled is not None else 1,
               _fit(cast_compiled, plan.cast_kw["num_warps"], plan.index))
        _plans[key] = _Plan(x, fmt, current, has_prev, acc_amax, transpose, fit)

"""Triton's interpreter with the GPU's rounding, for running fp8shard's kernels on the CPU.

``TRITON_INTERPRET=1`` (set before ``triton`` is first imported) makes ``triton.jit`` build
interpreted functions that run each program of a grid with numpy on CPU tensors. Two of the
interpreter's conversions differ from the GPU's and are given the GPU's semantics, which
PyTorch's conversions share: fp32 -> bf16 (the interpreter truncates; the GPU rounds to nearest
even) and fp32 -> FP8 (the GPU's ``cvt.rn.satfinite``; the kernels clamp to the format's range
before converting, so PyTorch's non-saturating conversion gives the same bytes).

Used by the tests (tests/triton_interp.py) and by benchmarks/compare_fused_adam_loss.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def gpu_like_conversions(convert: Callable) -> Callable:
    """The interpreter's ``_convert_float`` with the GPU's fp32 -> bf16 and fp32 -> FP8 rounding
    (see the module docstring); every other conversion is ``convert``'s. Import after
    ``TRITON_INTERPRET=1`` is set."""
    import numpy as np
    import triton.language as tl

    fp8 = {str(tl.float8e4nv): torch.float8_e4m3fn, str(tl.float8e5): torch.float8_e5m2}

    def gpu_like_convert(data, src, dst, rounding_mode):  # type: ignore[no-untyped-def]
        if src == tl.float32 and ((dst == tl.bfloat16 and rounding_mode is None) or str(dst) in fp8):
            t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            if dst == tl.bfloat16:
                return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return t.to(fp8[str(dst)]).view(torch.uint8).numpy()
        return convert(data, src, dst, rounding_mode)

    return gpu_like_convert


def interpret_fused_adam() -> None:
    """Serve the optimizer's fused step on CPU tensors with the interpreted kernels, whenever
    ``fp8shard.get_triton()`` allows (as ``use_triton`` does CUDA tensors). Process-wide; call it
    with ``TRITON_INTERPRET=1`` set before anything imported triton."""
    from triton.runtime import interpreter

    from fp8shard._triton import triton_enabled
    from fp8shard.optim import distributed_fused_adam, fused_step

    interpreter._convert_float = gpu_like_conversions(interpreter._convert_float)
    for mod in (fused_step, distributed_fused_adam):
        mod.use_triton = lambda *tensors: triton_enabled()  # type: ignore[attr-defined]

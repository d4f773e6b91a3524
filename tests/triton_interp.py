"""Running fp8shard's Triton kernels on the CPU with Triton's interpreter, for CI.

``TRITON_INTERPRET=1`` makes ``triton.jit`` build interpreted functions: each program of a grid
runs with numpy, on CPU tensors. The kernel modules are re-imported under it (their kernels are
made at import) and re-imported again afterwards. Two conversions of the interpreter differ from
the GPU's and are given the GPU's semantics, which PyTorch's conversions share: fp32 -> bf16 (the
interpreter truncates; the GPU rounds to nearest even) and fp32 -> FP8 (the GPU's
``cvt.rn.satfinite``; the kernels clamp to the format's range before converting, so PyTorch's
non-saturating conversion gives the same bytes).

What the interpreter checks: indexing, masks, reductions, the scale arithmetic, integer bit
tricks, stores. What it cannot: the compiled code (vectorized accesses under alignment hints,
fma contraction, the hardware's NaN signs): the GPU tests (``-m gpu``, on the H200) do that.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest
import torch

from fp8shard.testing.triton_interp import gpu_like_conversions

REASON = ("the interpreted-kernel tests need the triton package (Linux x86_64: "
          "pip install -e '.[interp]'; ./dev test installs it)")


@contextmanager
def interpreted(monkeypatch: pytest.MonkeyPatch, *modules: ModuleType) -> Iterator[None]:
    """``modules`` (Triton kernel modules) re-imported with interpreted kernels inside the block."""
    triton = pytest.importorskip("triton", reason=REASON)
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
        # e.g. 3.6's interpreter makes program ids arrays, so `range(pid, n, nprog)` fails.
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot run these kernels; the "
                    f"'interp' extra pins 3.9.0")
    import triton.language as tl
    from triton.runtime import interpreter

    if type(tl.max).__name__ != "InterpretedFunction":
        # triton.language was imported before TRITON_INTERPRET=1 (tests/conftest.py sets it on
        # machines without a GPU): its own functions are compiled-only and cannot be switched.
        if torch.cuda.is_available():
            pytest.skip("a GPU machine: the compiled kernels are tested by the gpu tests")
        raise AssertionError("triton.language was imported before TRITON_INTERPRET=1 was set; "
                             "tests/conftest.py must set it before anything imports triton")

    monkeypatch.setattr(interpreter, "_convert_float", gpu_like_conversions(interpreter._convert_float))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod in modules:
        importlib.reload(mod)
    try:
        yield
    finally:
        monkeypatch.undo()
        for mod in modules:
            importlib.reload(mod)

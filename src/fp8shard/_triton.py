"""When fp8shard's Triton kernels run instead of their PyTorch reference paths.

Triton is optional (CUDA only). Every kernel has a reference path in plain PyTorch that is the
specification: the tests compare the two. A Triton kernel serves a call only when all hold:

* ``triton`` imports (it ships with the CUDA builds of PyTorch);
* the tensors are on a CUDA device;
* we are not being traced by ``torch.compile`` (Inductor fuses the reference path itself);
* the environment does not say ``FP8SHARD_TRITON=0`` (to measure or debug the reference path).

The optimizer's fused step can be turned off alone with ``FP8SHARD_FUSED_ADAM=0``
(``fused_adam_enabled``).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install: fall back to the reference path
        return False
    return True


def _env_flag(name: str, default: str) -> bool:
    # Read at every call (tests and benchmarks flip it), parsed once per value: this runs for
    # every FP8 cast, on the host path the GPU waits for.
    return _parse_flag(name, os.environ.get(name, default))


@functools.lru_cache(maxsize=64)
def _parse_flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "on")


def triton_enabled() -> bool:
    """Whether the environment allows the Triton kernels (``FP8SHARD_TRITON``, default on)."""
    return _env_flag("FP8SHARD_TRITON", "1")


def fused_adam_enabled() -> bool:
    """Whether ``DistributedFusedAdam`` may take its fused Triton step (``FP8SHARD_FUSED_ADAM``).

    Default on: the kernels match their reference on the H200 (tests/optim/test_fused_step.py,
    GPU-marked) and under Triton's interpreter on the CPU. ``FP8SHARD_FUSED_ADAM=0`` takes the
    PyTorch path (to compare, or to debug); ``FP8SHARD_TRITON=0`` turns them off too.
    """
    return _env_flag("FP8SHARD_FUSED_ADAM", "1")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when a Triton kernel should serve a call on ``tensors`` (see the module docstring)."""
    if not all(t.is_cuda for t in tensors):
        return False
    if torch.compiler.is_compiling():
        return False
    return triton_enabled() and triton_importable()

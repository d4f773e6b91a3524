"""When fp8shard's Triton kernels run instead of their PyTorch reference paths.

Triton is optional (CUDA only). Every kernel has a reference path in plain PyTorch that is the
specification: the tests compare the two. A Triton kernel serves a call only when all hold:

* ``triton`` imports (it ships with the CUDA builds of PyTorch);
* the tensors are on a CUDA device;
* we are not being traced by ``torch.compile`` (Inductor fuses the reference path itself);
* the kernels are switched on: ``fp8shard.set_triton`` (default on; the training command's
  ``trainer.triton``) -- off measures or debugs the reference path.

The optimizer's fused step has its own switch, ``DistributedFusedAdam(fused=...)``
(``model.optim.fused``).
"""

from __future__ import annotations

import functools

import torch

_enabled = True  # set_triton(None) restores it


@functools.cache
def triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install: fall back to the reference path
        return False
    return True


def set_triton(enabled: bool | None) -> None:
    """Let fp8shard's Triton kernels serve the calls they can (``True``, the default) or take the
    PyTorch reference paths everywhere (``False``: to measure or debug them); ``None`` restores the
    default. Process-wide; the training command sets it from ``trainer.triton``."""
    global _enabled
    if enabled is None:
        enabled = True
    if not isinstance(enabled, bool):
        raise ValueError(f"set_triton takes True, False or None (the default), got {enabled!r}")
    _enabled = enabled


def get_triton() -> bool:
    """The setting made with :func:`set_triton` (``True`` unless changed)."""
    return _enabled


def triton_enabled() -> bool:
    """Whether the Triton kernels are switched on (:func:`get_triton`)."""
    return _enabled


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when a Triton kernel should serve a call on ``tensors`` (see the module docstring)."""
    if not all(t.is_cuda for t in tensors):
        return False
    if torch.compiler.is_compiling():
        return False
    return _enabled and triton_importable()

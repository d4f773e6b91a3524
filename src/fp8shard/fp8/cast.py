"""The FP8 cast itself: scale, saturate, round to nearest even. See [Note: scale]."""

from __future__ import annotations

import torch

from fp8shard.fp8.formats import Fp8Format


def cast_to_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: Fp8Format,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``saturate(round(x * scale))`` as ``fmt.torch_dtype``; writes into ``out`` if given.

    The product is taken in fp32; ``clamp`` saturates +-inf to +-max and leaves NaN as NaN;
    PyTorch's float8 conversion rounds to nearest even. ``out`` may be a float8 tensor of
    ``fmt`` or a ``uint8`` tensor (the same bytes, as collectives move them).
    """
    hp = x.float() * scale.float()
    lp = hp.clamp_(-fmt.max, fmt.max).to(fmt.torch_dtype)
    if out is None:
        return lp
    if out.dtype == torch.uint8:
        out.copy_(lp.view(torch.uint8))
    else:
        out.copy_(lp)
    return out


def cast_from_fp8(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale_inv`` in fp32, returned as ``dtype``."""
    return (data.float() * scale_inv.float()).to(dtype)

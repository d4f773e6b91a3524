"""FP8 formats. See [Note: formats] in docs/design.md."""

from __future__ import annotations

import enum

import torch


class Fp8Format(enum.Enum):
    """An 8-bit floating-point format: its torch dtype and largest finite value.

    E4M3 (``torch.float8_e4m3fn``, max 448) carries weights and activations; E5M2
    (``torch.float8_e5m2``, max 57344) carries gradients in the HYBRID recipe.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    # Plain attributes of each member (set below), not properties: reading them is no call on
    # the hot paths (the optimizer step, every cast).
    torch_dtype: torch.dtype
    max: float

    @classmethod
    def parse(cls, fmt: object) -> Fp8Format:
        """Accept an ``Fp8Format``, its name or value ("E4M3", "e5m2") or its torch dtype."""
        if isinstance(fmt, Fp8Format):
            return fmt
        if isinstance(fmt, torch.dtype):
            for f in cls:
                if f.torch_dtype == fmt:
                    return f
        if isinstance(fmt, str):
            for f in cls:
                if fmt.lower() == f.value:
                    return f
        choices = ", ".join(f"Fp8Format.{f.name}" for f in cls)
        raise ValueError(f"unknown FP8 format {fmt!r}; choose one of {choices}")


for _fmt, _dtype in ((Fp8Format.E4M3, torch.float8_e4m3fn), (Fp8Format.E5M2, torch.float8_e5m2)):
    _fmt.torch_dtype = _dtype
    _fmt.max = float(torch.finfo(_dtype).max)
del _fmt, _dtype

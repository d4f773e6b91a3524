"""Scale arithmetic and the scaling recipes. See [Note: scale] in docs/design.md.

[Note: scale]
    fp8 = saturate(round(x * scale)),  x ~= fp8.float() * scale_inv,  scale_inv = 1 / scale.
    Current scaling: scale = fmt.max / amax(x).  Delayed scaling: amax comes from a history
    of past amaxes (max over the window, or the most recent), and
    scale = fmt.max / amax / 2**margin.  An amax of zero, a non-finite amax, or a scale that
    would overflow keeps the previous scale (1.0 when there is none).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

import torch

from fp8shard.fp8.formats import Fp8Format


def scale_from_amax(
    amax: torch.Tensor,
    fmt_max: float | torch.Tensor,
    prev_scale: torch.Tensor | None = None,
    margin: int = 0,
) -> torch.Tensor:
    """fp32 scale(s) ``fmt_max / amax / 2**margin`` with the guards of [Note: scale].

    Works elementwise, so a packed vector of amaxes gives a vector of scales in one call.
    """
    amax = amax.float()
    scale = (fmt_max / amax) / (2.0**margin)
    prev = torch.ones_like(amax) if prev_scale is None else prev_scale.float()
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale) & (scale > 0)
    return torch.where(ok, scale, prev)


def amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 0-d max |x|; 0 for an empty tensor; NaN if x holds a NaN."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # torch.max propagates NaN, so a NaN in x shows up as a non-finite amax.
    return x.detach().abs().max().float()


class RecipeFormat(enum.Enum):
    """Which FP8 format each pass uses. HYBRID: E4M3 forward, E5M2 gradients."""

    HYBRID = "hybrid"
    E4M3 = "e4m3"

    @property
    def fwd(self) -> Fp8Format:
        return Fp8Format.E4M3

    @property
    def bwd(self) -> Fp8Format:
        return Fp8Format.E5M2 if self is RecipeFormat.HYBRID else Fp8Format.E4M3


def _parse_recipe_format(value: RecipeFormat | str) -> RecipeFormat:
    if isinstance(value, RecipeFormat):
        return value
    for f in RecipeFormat:
        if str(value).lower() == f.value:
            return f
    raise ValueError(f"unknown fp8_format {value!r}; choose 'hybrid' or 'e4m3'")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor current scaling: every cast uses the amax of the tensor being cast."""

    fp8_format: RecipeFormat = RecipeFormat.HYBRID
    """HYBRID (E4M3 forward, E5M2 gradients) or E4M3 everywhere."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _parse_recipe_format(self.fp8_format))


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's delayed scaling: scales come from a history of past amaxes."""

    margin: int = 0
    """scale = fmt.max / amax / 2**margin."""
    fp8_format: RecipeFormat = RecipeFormat.HYBRID
    """HYBRID (E4M3 forward, E5M2 gradients) or E4M3 everywhere."""
    amax_history_len: int = 1024
    """How many past amaxes each operand keeps."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """Reduce the history by its maximum or take the newest entry."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _parse_recipe_format(self.fp8_format))
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be a non-negative int, got {self.margin!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(
                f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )


@dataclasses.dataclass(frozen=True)
class RowwiseScaling:
    """One scale per row of each GEMM operand, along the contraction dim (torchao's "rowwise").

    Current scaling only: every cast takes the amaxes of the rows it casts ([Note: quantizer]
    in ``fp8/quantizer.py``). E4M3 everywhere by default, as torchao's recipe: a scale per row
    covers the gradients' range without E5M2's extra exponent bit.
    """

    fp8_format: RecipeFormat = RecipeFormat.E4M3
    """E4M3 everywhere, or HYBRID (E4M3 forward, E5M2 gradients)."""
    power_of_2_scales: bool = False
    """Round each scale down to a power of two (exact scaling and unscaling)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _parse_recipe_format(self.fp8_format))


@dataclasses.dataclass(frozen=True)
class BlockwiseScaling:
    """DeepSeek-V3's fine-grained recipe: activations and gradients get one scale per 1 x
    ``block_size`` tile along the contraction dim, weights one per ``block_size`` squared block.

    Current scaling only ([Note: quantizer]); E4M3 everywhere by default, as DeepSeek-V3.
    """

    fp8_format: RecipeFormat = RecipeFormat.E4M3
    """E4M3 everywhere, or HYBRID (E4M3 forward, E5M2 gradients)."""
    block_size: int = 128
    """Tile length of activations and gradients, side of the weights' square blocks."""
    power_of_2_scales: bool = False
    """Round each scale down to a power of two (exact scaling and unscaling)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _parse_recipe_format(self.fp8_format))
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}; DeepSeek-V3 uses 128")


Recipe = CurrentScaling | DelayedScaling | RowwiseScaling | BlockwiseScaling


class AmaxHistory:
    """Delayed-scaling state for ``n`` tensor slots: an amax history and a scale per slot.

    Protocol (Transformer Engine's): casts in iteration i use ``scale`` and record their amax
    into ``history[0]`` with :meth:`record`; after the iteration (and after the amaxes were
    reduced over the group, if any) :meth:`update` computes new scales from the whole window
    and rolls the window so ``history[0]`` is free for the next iteration.
    """

    def __init__(self, n: int, recipe: DelayedScaling, fmt_max: torch.Tensor | float,
                 device: torch.device | str | None = None) -> None:
        self.recipe = recipe
        self.history = torch.zeros(recipe.amax_history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.fmt_max = torch.as_tensor(fmt_max, dtype=torch.float32, device=device)

    def record(self, slot: int, amax_value: torch.Tensor) -> None:
        cur = self.history[0, slot]
        self.history[0, slot] = torch.maximum(cur, amax_value.float())

    def update(self) -> torch.Tensor:
        if self.recipe.amax_compute_algo == "max":
            window_amax = self.history.amax(dim=0)
        else:
            window_amax = self.history[0]
        self.scale = scale_from_amax(window_amax, self.fmt_max, self.scale, self.recipe.margin)
        self.history = torch.roll(self.history, shifts=-1, dims=0)
        self.history[0].zero_()
        return self.scale

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"amax_history": self.history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if sd["amax_history"].shape != self.history.shape:
            raise ValueError(
                f"amax history shape {tuple(sd['amax_history'].shape)} does not match "
                f"{tuple(self.history.shape)}: was amax_history_len changed?"
            )
        self.history.copy_(sd["amax_history"])
        self.scale.copy_(sd["scale"])

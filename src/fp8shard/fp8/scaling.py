"""The scaling recipes (and by name: ``parse_recipe``), and the scale convention. See [Note: scale]
in docs/design.md.

The arithmetic (the encoding ``cast_to_fp8``; ``scale_from_amax``, ``amax``, ``AmaxHistory``)
lives in ``fp8/quantizer.py``, beside the quantizers that use it ([Note: quantizer]); the names
of the scale rule stay importable from here.

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

from fp8shard.fp8.formats import Fp8Format


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



# ------------------------------------------------------------------------------ recipes by name
RECIPE_NAMES = ("delayed", "current", "tensorwise", "rowwise", "blockwise")
_RECIPE_TYPES = (DelayedScaling, CurrentScaling, RowwiseScaling, BlockwiseScaling)


def parse_recipe(recipe: Recipe | str) -> Recipe:
    """A recipe object, or one made from its name: ``delayed`` (``DelayedScaling()``),
    ``current`` or ``tensorwise`` (``CurrentScaling()``), ``rowwise``, ``blockwise``."""
    if isinstance(recipe, _RECIPE_TYPES):
        return recipe
    if isinstance(recipe, str):
        name = recipe.lower()
        if name == "delayed":
            return DelayedScaling()
        if name in ("current", "tensorwise"):
            return CurrentScaling()
        if name == "rowwise":
            return RowwiseScaling()
        if name == "blockwise":
            return BlockwiseScaling()
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {', '.join(RECIPE_NAMES)}")
    raise TypeError(
        f"an FP8 recipe is a name ({', '.join(RECIPE_NAMES)}) or a fp8shard DelayedScaling, "
        f"CurrentScaling, RowwiseScaling or BlockwiseScaling, got "
        f"{type(recipe).__module__}.{type(recipe).__name__}; build one with e.g. fp8shard.RowwiseScaling()")


def is_tiled(recipe: object) -> bool:
    """Whether ``recipe`` scales per tile (rowwise, blockwise) rather than per tensor."""
    return isinstance(recipe, (RowwiseScaling, BlockwiseScaling))


_MOVED = ("AmaxHistory", "amax", "scale_from_amax")


def __getattr__(name: str) -> object:
    """``scale_from_amax``, ``amax`` and ``AmaxHistory`` from ``fp8/quantizer.py``, as before."""
    if name in _MOVED:
        from fp8shard.fp8 import quantizer

        return getattr(quantizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

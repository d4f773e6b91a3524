"""``fp8_autocast``: where fp8shard layers compute in FP8.

Entering it is free: it only says which recipe the layers use. The delayed-scaling amaxes the
layers record are reduced by ``fs.nn.AmaxSync``, which the training loop calls after each
backward ([Note: amax reduction] in nn/amax_sync.py); there is no collective here and no
module-level registry of layers. Keep ``fp8_autocast`` outside a ``torch.compile``d region
(compile the model, not the step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

from fp8shard.fp8.quantizer import RECIPE_NAMES, parse_recipe
from fp8shard.fp8.scaling import BlockwiseScaling, CurrentScaling, DelayedScaling, Recipe, RowwiseScaling


@dataclasses.dataclass(frozen=True)
class Fp8State:
    """What an enabled ``fp8_autocast`` tells the layers: the recipe."""

    recipe: Recipe
    group: Any = None
    """The ``fp8_group`` it was given (unused: ``AmaxSync`` owns the group now)."""


# The states of the fp8_autocasts the current code runs in, innermost last (None: FP8 off).
_stack: list[Fp8State | None] = []

FP8_GROUP_MOVED = (
    "fp8_autocast(fp8_group=...) no longer reduces the delayed-scaling amaxes (entering it runs no "
    "collective now); create sync = fs.nn.AmaxSync(model, group=fp8_group) once and call "
    "sync.step() after each backward, then drop fp8_group")


def _check_args(enabled: bool, recipe: object) -> Recipe | None:
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast(enabled=...) takes a bool, got {type(enabled).__name__}")
    if recipe is not None and not isinstance(recipe, (str, DelayedScaling, CurrentScaling, RowwiseScaling,
                                                      BlockwiseScaling)):
        raise TypeError(
            f"fp8_autocast(recipe=...) takes a fp8shard DelayedScaling, CurrentScaling, RowwiseScaling "
            f"or BlockwiseScaling, or a recipe name ({', '.join(RECIPE_NAMES)}), got "
            f"{type(recipe).__module__}.{type(recipe).__name__}; build one with "
            f"fp8shard.DelayedScaling(...) or fp8shard.CurrentScaling(...)"
        )
    return None if recipe is None else parse_recipe(recipe)  # a name: ValueError naming the choices


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True, recipe: Recipe | None = None, fp8_group: Any = None
) -> Iterator[None]:
    """fp8shard layers run inside compute their GEMMs in FP8 ([Note: three GEMMs]).

    ``recipe`` defaults to ``DelayedScaling()`` (Transformer Engine's default); a recipe object
    or its name (``delayed``, ``current``/``tensorwise``, ``rowwise``, ``blockwise``: see
    [Note: quantizer]); a layer's own ``fp8_recipe`` attribute overrides it. ``enabled=False``
    turns FP8 off inside, e.g. for an evaluation pass in a FP8-enabled region. ``fp8_group`` is
    unused (a ``FutureWarning``): the delayed-scaling amaxes are reduced by ``fs.nn.AmaxSync``
    ([Note: amax reduction] in nn/amax_sync.py).
    """
    recipe = _check_args(enabled, recipe)
    if fp8_group is not None:
        warnings.warn(FP8_GROUP_MOVED, FutureWarning, stacklevel=3)
    state = Fp8State(recipe if recipe is not None else DelayedScaling(), fp8_group) if enabled else None
    _stack.append(state)
    try:
        yield
    finally:
        _stack.pop()


def current_fp8_state() -> Fp8State | None:
    """The innermost ``fp8_autocast``'s state, or None where FP8 is off."""
    return _stack[-1] if _stack else None

"""``fp8_autocast``: where fp8shard layers compute in FP8, and the once-per-step amax reduction.

[Note: amax reduction]
    Under a ``DelayedScaling`` recipe every FP8 layer records the amax of its three GEMM
    operands (input, weight, output gradient) into row 0 of its amax history while it runs, and
    registers itself as *pending*. At the entry of the next enabled (outermost) ``fp8_autocast``
    -- after the previous step's backward has recorded its gradient amaxes -- the pending rows of
    all layers are packed into one ``[n_layers, 3]`` tensor, all-reduced with MAX over the
    autocast's ``fp8_group`` in **one** collective, written back, and each layer's
    ``AmaxHistory.update`` turns its window into new scales and rolls it. So each step costs one
    all-reduce however many layers there are, and every rank of the group computes the same
    scales. ``fp8_group=None`` means no reduction (each rank keeps its local amaxes).
    ``CurrentScaling`` takes the amax of the tensor being cast and needs no reduction.
    Keep ``fp8_autocast`` outside a ``torch.compile``d region (compile the model, not the step):
    the reduction is a host-side collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fp8shard.fp8.scaling import CurrentScaling, DelayedScaling, Recipe


@dataclasses.dataclass(frozen=True)
class Fp8State:
    """What an enabled ``fp8_autocast`` tells the layers: the recipe and the amax group."""

    recipe: Recipe
    group: Any = None


_stack: list[Fp8State | None] = []
# Layers that recorded delayed-scaling amaxes since the last reduction, keyed by id (ordered).
_pending: dict[int, tuple[Any, Any]] = {}


def _check_args(enabled: bool, recipe: object) -> None:
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast(enabled=...) takes a bool, got {type(enabled).__name__}")
    if recipe is not None and not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise TypeError(
            f"fp8_autocast(recipe=...) takes a fp8shard DelayedScaling or CurrentScaling, got "
            f"{type(recipe).__module__}.{type(recipe).__name__}; build one with "
            f"fp8shard.DelayedScaling(...) or fp8shard.CurrentScaling(...)"
        )


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True, recipe: Recipe | None = None, fp8_group: Any = None
) -> Iterator[None]:
    """fp8shard layers run inside compute their GEMMs in FP8 ([Note: three GEMMs]).

    ``recipe`` defaults to ``DelayedScaling()`` (Transformer Engine's default). ``fp8_group`` is
    the process group the delayed-scaling amaxes are MAX-reduced over, once per step (the
    data-parallel group, or TP x DP); see [Note: amax reduction]. ``enabled=False`` turns FP8 off
    inside, e.g. for an evaluation pass in a FP8-enabled region.
    """
    _check_args(enabled, recipe)
    if enabled and current_fp8_state() is None:
        reduce_and_update_amaxes()  # the previous step's amaxes are all recorded now
    state = Fp8State(recipe if recipe is not None else DelayedScaling(), fp8_group) if enabled else None
    _stack.append(state)
    try:
        yield
    finally:
        _stack.pop()


def current_fp8_state() -> Fp8State | None:
    """The innermost ``fp8_autocast``'s state, or None where FP8 is off."""
    return _stack[-1] if _stack else None


def register_pending(layer: Any, group: Any) -> None:
    """Called by a layer that recorded delayed-scaling amaxes this step."""
    _pending[id(layer)] = (layer, group)


def reduce_and_update_amaxes() -> int:
    """Reduce all pending amaxes (one all-reduce per group) and update every layer's scales.

    Runs by itself at the next ``fp8_autocast`` entry; call it directly after the last step if
    the final scales matter (e.g. before saving a checkpoint). Returns the number of layers.
    """
    if not _pending:
        return 0
    by_group: dict[int, tuple[Any, list[Any]]] = {}
    for layer, group in _pending.values():
        by_group.setdefault(id(group), (group, []))[1].append(layer)
    _pending.clear()
    for group, layers in by_group.values():
        _reduce_group(layers, group)
    return sum(len(layers) for _, layers in by_group.values())


def _reduce_group(layers: list[Any], group: Any) -> None:
    # [n_layers, 3]: row 0 of each layer's history, the amaxes recorded since the last update.
    packed = torch.stack([layer.fp8_amax_history[0] for layer in layers])
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    for layer, row in zip(layers, packed, strict=True):
        layer.fp8_amax_history[0].copy_(row)
        layer.update_fp8_scales()

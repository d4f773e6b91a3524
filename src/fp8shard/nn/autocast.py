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

    Layers given to ``fs.nn.prepare_delayed_scaling`` (what a compiled model needs, see
    [Note: compile] in docs/nn.md) do not register per call: registering mutates a Python dict
    that ``torch.compile`` would have to guard on, so every block of a per-block compiled model
    would see a different dict and recompile. They are registered once, in order, and reduced
    at every reduction that follows an enabled outermost ``fp8_autocast``, over that autocast's
    ``fp8_group``; a prepared layer that recorded nothing since the last reduction (its row 0 is
    all zero: it did not run) keeps its window and scales, decided on the device (no sync).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fp8shard.fp8.scaling import CurrentScaling, DelayedScaling, Recipe
from fp8shard.nn import overflow


@dataclasses.dataclass(frozen=True)
class Fp8State:
    """What an enabled ``fp8_autocast`` tells the layers: the recipe and the amax group."""

    recipe: Recipe
    group: Any = None


_stack: list[Fp8State | None] = []
# Layers that recorded delayed-scaling amaxes since the last reduction, keyed by id (ordered).
_pending: dict[int, tuple[Any, Any]] = {}
# Prepared layers (``register_every_step``), reduced at every reduction after an autocast ran:
# id -> weak reference, in registration order (the same order on every rank).
_every_step: dict[int, weakref.ref] = {}
# The group of the last enabled outermost autocast, and whether one ran since the last reduction.
_every_step_group: list[Any] = [None]
_every_step_due: list[bool] = [False]


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
        _every_step_group[0], _every_step_due[0] = fp8_group, True
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
    if getattr(layer, "_fp8_reduce_every_step", False):
        return  # registered once for good (see the module docstring): nothing for compile to guard
    _pending[id(layer)] = (layer, group)


def register_every_step(layer: Any) -> None:
    """Reduce ``layer``'s amaxes at every reduction from now on, without per-call registration."""
    layer._fp8_reduce_every_step = True
    _every_step.pop(id(layer), None)
    _every_step[id(layer)] = weakref.ref(layer)


def reduce_and_update_amaxes() -> int:
    """Reduce all pending amaxes (one all-reduce per group) and update every layer's scales.

    Runs by itself at the next ``fp8_autocast`` entry; call it directly after the last step if
    the final scales matter (e.g. before saving a checkpoint). Returns the number of layers.
    """
    every = _every_step_layers() if _every_step_due[0] else []
    _every_step_due[0] = False
    if not _pending and not every:
        return 0
    by_group: dict[int, tuple[Any, list[Any]]] = {}
    for layer, group in _pending.values():
        by_group.setdefault(id(group), (group, []))[1].append(layer)
    _pending.clear()
    for group, layers in by_group.values():
        _reduce_group(layers, group)
    if every:
        _reduce_group(every, _every_step_group[0], only_if_ran=True)
    return sum(len(layers) for _, layers in by_group.values()) + len(every)


def _every_step_layers() -> list[Any]:
    """The live prepared layers that have delayed-scaling state, in registration order."""
    out = []
    for key, ref in list(_every_step.items()):
        layer = ref()
        if layer is None:
            del _every_step[key]
        elif getattr(layer, "fp8_amax_history", None) is not None and layer._amax_state is not None:
            out.append(layer)
    return out


def _reduce_group(layers: list[Any], group: Any, only_if_ran: bool = False) -> None:
    # [n_layers, 3]: row 0 of each layer's history, the amaxes recorded since the last update.
    packed = torch.stack([layer.fp8_amax_history[0] for layer in layers])
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    overflow.observe(layers, packed)  # [Note: overflow check]: before the scales change
    ran = (packed != 0).any(dim=1) if only_if_ran else None  # NaN != 0: a NaN amax counts
    for i, (layer, row) in enumerate(zip(layers, packed, strict=True)):
        if ran is None:
            layer.fp8_amax_history[0].copy_(row)
            layer.update_fp8_scales()
            continue
        # Decided on the device: a prepared layer that did not run keeps its state.
        hist, scale = layer.fp8_amax_history, layer.fp8_scale
        old_hist, old_scale = hist.clone(), scale.clone()
        hist[0].copy_(row)
        layer.update_fp8_scales()
        hist.copy_(torch.where(ran[i], hist, old_hist))
        scale.copy_(torch.where(ran[i], scale, old_scale))

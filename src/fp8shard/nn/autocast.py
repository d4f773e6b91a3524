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

from fp8shard.fp8.quantizer import RECIPE_NAMES, parse_recipe
from fp8shard.fp8.scaling import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Recipe,
    RowwiseScaling,
    scale_from_amax,
)
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
    [Note: quantizer]); a layer's own ``fp8_recipe`` attribute overrides it. ``fp8_group`` is
    the process group the delayed-scaling amaxes are MAX-reduced over, once per step (the
    data-parallel group, or TP x DP); see [Note: amax reduction]. ``enabled=False`` turns FP8 off
    inside, e.g. for an evaluation pass in a FP8-enabled region.
    """
    recipe = _check_args(enabled, recipe)
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
    # Layers of one recipe and device are updated together: a fixed number of kernels per step
    # instead of some twenty per layer (one GPU launch each) -- [Note: batched scale update].
    batches: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        h = layer.fp8_amax_history
        batches.setdefault((layer._amax_state.recipe, tuple(h.shape), h.device), []).append(i)
    for (recipe, _, _), idx in batches.items():
        rows = packed if len(idx) == len(layers) else packed[idx]
        _update_scales([layers[i] for i in idx], recipe, rows,
                       None if ran is None else (ran if len(idx) == len(layers) else ran[idx]))


# [Note: batched scale update]
#     What ``Linear.update_fp8_scales`` (``AmaxHistory.update``) does to one layer, done to a
#     stack of L layers' ``[len, 3]`` histories at once: row 0 <- the reduced amaxes, scales from
#     the window (``scale_from_amax``, elementwise, so the same bits as layer by layer), roll,
#     zero row 0, and the results copied back into each layer's buffers in place (tensors a
#     pending backward captured stay live). With ``ran`` (prepared layers), a layer whose row
#     was all zero keeps its old window and scales, decided on the device.
def _update_scales(layers: list[Any], recipe: DelayedScaling, rows: torch.Tensor,
                   ran: torch.Tensor | None) -> None:
    hists = [layer.fp8_amax_history for layer in layers]
    scales = [layer.fp8_scale for layer in layers]
    device = hists[0].device
    old_h, old_s = torch.stack(hists), torch.stack(scales)  # [L, len, 3], [L, 3]
    fmt_max = torch.stack([layer._amax_state.fmt_max.to(device) for layer in layers])
    h = old_h.clone()
    h[:, 0] = rows
    window = h.amax(dim=1) if recipe.amax_compute_algo == "max" else h[:, 0]
    new_s = scale_from_amax(window, fmt_max, old_s, recipe.margin)
    h = torch.roll(h, shifts=-1, dims=1)
    h[:, 0].zero_()
    if ran is not None:
        h = torch.where(ran[:, None, None], h, old_h)
        new_s = torch.where(ran[:, None], new_s, old_s)
    torch._foreach_copy_(hists, list(h.unbind(0)))
    torch._foreach_copy_(scales, list(new_s.unbind(0)))
    for layer in layers:  # the layer's AmaxHistory keeps pointing at its buffers
        state = layer._amax_state
        state.history, state.scale = layer.fp8_amax_history, layer.fp8_scale

"""``AmaxSync``: the delayed-scaling amax synchronisation of one model, called by the training loop.

[Note: amax reduction]
    Under a ``DelayedScaling`` recipe every FP8 layer records the amax of its three GEMM
    operands (input, weight, output gradient) into row 0 of its amax history while it runs
    (forward and backward). ``AmaxSync(model, group).step()``, called by the training loop after
    each backward (each micro-batch), packs row 0 of every delayed-scaling ``fs.nn.Linear`` of
    the model into one ``[n_layers, 3]`` fp32 tensor, all-reduces it with MAX over ``group`` in
    **one** collective (through ``fp8shard.optim.collectives``, fp32 so gloo takes it), writes
    it back, and turns each layer's window into new scales and rolls it ([Note: batched scale
    update]). So each micro-batch costs one all-reduce however many layers there are, and every
    rank of the group computes the same scales. It is torchao's
    ``sync_float8_amax_and_scale_history``, as an object that owns the group.

    Nothing else reduces: ``fp8_autocast`` runs no collective (entering it is free) and there
    is no module-level registry of layers; the layers are the model's, found in
    ``model.modules()`` order (the same on every rank), those that have delayed-scaling state.
    A layer that recorded nothing since the last step (its row 0 is all zero: it did not run)
    keeps its window and scales, decided on the device (no host sync). ``CurrentScaling`` takes
    the amax of the tensor being cast and needs no reduction (``step()`` finds no layers).
    ``step()`` is eager (a host-side collective): call it outside any ``torch.compile``d region.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fp8shard.fp8.quantizer import scale_from_amax
from fp8shard.fp8.scaling import DelayedScaling
from fp8shard.nn import overflow
from fp8shard.nn.linear import Linear

AMAX_KIND = "all_reduce.fp8_activation_amax"
"""The collective's name in ``AmaxSync.counter`` (and the training summary's bytes by collective)."""


class AmaxSync:
    """Owns the amax all-reduce of ``model``'s delayed-scaling FP8 layers ([Note: amax reduction]).

    ``group``: the process group to MAX-reduce over (the data-parallel group, or TP x DP);
    None is the default group when ``torch.distributed`` is initialized, else a single process
    (``step()`` then updates the scales from the local amaxes, no collective). ``counter``: a
    ``fp8shard.optim.collectives.CommCounter`` to count the bytes in (default: its own,
    ``self.counter``).
    """

    def __init__(self, model: nn.Module, group: Any = None, counter: Any = None) -> None:
        # The one module that calls torch.distributed; imported here because optim/ imports nn/.
        from fp8shard.optim.collectives import CommCounter, Group

        if not isinstance(model, nn.Module):
            raise TypeError(f"AmaxSync(model, ...) takes the torch.nn.Module whose fp8shard.nn.Linear "
                            f"layers it synchronises, got {type(model).__module__}.{type(model).__name__}")
        if not any(isinstance(m, Linear) for m in model.modules()):
            raise ValueError(f"AmaxSync: {type(model).__name__} has no fp8shard.nn.Linear layer, so no "
                             f"amax to synchronise; convert it first (fs.convert_to_fp8(model)) or "
                             f"build it with fs.nn.Linear layers")
        self.model = model
        self.counter = counter if counter is not None else CommCounter()
        self._group = Group(group, self.counter)

    @property
    def world_size(self) -> int:
        return self._group.world_size

    def layers(self) -> list[Linear]:
        """The model's layers that have delayed-scaling state, in ``model.modules()`` order."""
        return [m for m in self.model.modules() if isinstance(m, Linear)
                and m._amax_state is not None and getattr(m, "fp8_amax_history", None) is not None]

    def first_call_pending(self) -> bool:
        """Whether one of ``layers()`` has not yet made its informed first call ([Note: informed
        first call]): its next forward takes the first-call branch ([Note: compiled first call])."""
        return any(layer._fp8_history_empty for layer in self.layers())

    def step(self) -> int:
        """Reduce the amaxes recorded since the last step (one all-reduce) and update every
        layer's scales; returns the number of layers. Call it after each backward."""
        layers = self.layers()
        if not layers:
            return 0
        # [n_layers, 3] fp32: row 0 of each history, the amaxes recorded since the last step.
        packed = torch.stack([layer.fp8_amax_history[0] for layer in layers])
        self._group.all_reduce(packed, "max", AMAX_KIND)
        update_scales(layers, packed)
        return len(layers)


def update_scales(layers: list[Linear], packed: torch.Tensor) -> None:
    """New scales and rolled windows for ``layers`` from their reduced amaxes ``packed``
    ([n_layers, 3]); a layer whose row is all zero (it did not run) keeps its state."""
    _observe_overflows(layers, packed)
    ran = (packed != 0).any(dim=1)  # NaN != 0: a NaN amax counts
    # Layers of one recipe and device are updated together: a fixed number of kernels per step
    # instead of some twenty per layer (one GPU launch each) -- [Note: batched scale update].
    batches: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        h = layer.fp8_amax_history
        batches.setdefault((layer._amax_state.recipe, tuple(h.shape), h.device), []).append(i)
    for (recipe, _, _), idx in batches.items():
        whole = len(idx) == len(layers)
        _update_batch([layers[i] for i in idx], recipe, packed if whole else packed[idx],
                      ran if whole else ran[idx])


def _observe_overflows(layers: list[Linear], packed: torch.Tensor) -> None:
    """[Note: overflow check], before the scales change; a layer whose casts since the last
    update were its informed first call's ([Note: informed first call]) used no ``fp8_scale``."""
    fresh = [layer._fp8_unscaled_since_update for layer in layers]
    if not any(fresh):
        overflow.observe(layers, packed)
        return
    keep = [i for i, f in enumerate(fresh) if not f]
    if keep:
        overflow.observe([layers[i] for i in keep], packed[keep])
    for layer in layers:
        layer._fp8_unscaled_since_update = False


# [Note: batched scale update]
#     What ``Linear.update_fp8_scales`` (``AmaxHistory.update``) does to one layer, done to a
#     stack of L layers' ``[len, 3]`` histories at once: row 0 <- the reduced amaxes, scales from
#     the window (``scale_from_amax``, elementwise, so the same bits as layer by layer), roll,
#     zero row 0, and the results copied back into each layer's buffers in place (tensors a
#     pending backward captured stay live). A layer whose row was all zero (``ran`` false) keeps
#     its old window and scales, decided on the device.
def _update_batch(layers: list[Linear], recipe: DelayedScaling, rows: torch.Tensor,
                  ran: torch.Tensor) -> None:
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
    h = torch.where(ran[:, None, None], h, old_h)
    new_s = torch.where(ran[:, None], new_s, old_s)
    torch._foreach_copy_(hists, list(h.unbind(0)))
    torch._foreach_copy_(scales, list(new_s.unbind(0)))
    for layer in layers:  # the layer's AmaxHistory keeps pointing at its buffers
        state = layer._amax_state
        state.history, state.scale = layer.fp8_amax_history, layer.fp8_scale


def reduce_and_update_amaxes(model: nn.Module | None = None, group: Any = None) -> int:
    """``AmaxSync(model, group).step()`` once (e.g. after the last step, in a script).

    Kept from before ``AmaxSync``: it used to find the layers in a module-level registry, which
    is gone, so it now needs the model.
    """
    if model is None:
        raise TypeError("reduce_and_update_amaxes() needs the model now: fp8shard keeps no registry "
                        "of FP8 layers; call fs.nn.reduce_and_update_amaxes(model, group), or better "
                        "create sync = fs.nn.AmaxSync(model, group) once and call sync.step() after "
                        "each backward")
    return AmaxSync(model, group).step()

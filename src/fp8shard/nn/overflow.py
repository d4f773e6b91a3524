"""FP8 overflow reporting: which layer's cast saturated, found at the once-per-step amax reduction.

[Note: overflow check]
    Under delayed scaling a cast uses the scale computed from *past* amaxes, so a value beyond
    ``fmt.max / scale`` saturates to ``fmt.max`` (an FP8 overflow) and nothing else notices: the
    next scale adapts silently ([Note: scale]). The amax reduction of ``AmaxSync.step()``
    ([Note: amax reduction]) already holds, for every layer, the amaxes its casts saw since the
    last reduction, reduced over the group (``packed``, ``[n_layers, 3]``), and the scales those
    casts used are still the layers' ``fp8_scale`` (the update comes right after). So an
    :class:`OverflowMonitor` compares them there, on the device, with a few elementwise ops per
    reduction and no host sync: ``amax * scale > fmt.max`` means the cast saturated. Delayed
    scaling saturates a little all the time (an amax a few percent above the window's maximum;
    gradients up to 2.6x in the default 150-step run), so the monitor *counts* every saturated
    operand but *reports* (with the layer's name) only an overflow by more than ``factor``:
    ``amax * scale > factor * fmt.max``, a spike. A non-finite amax is reported apart (its scale
    is kept). Hits accumulate in device tensors; :meth:`OverflowMonitor.poll` costs one host
    sync (two counts) and copies the details only when there is something to report. The
    training command polls once per step (it syncs the loss there anyway).

    The operands are the input (E4M3), the weight (E4M3; only a high-precision weight has a
    delayed scale: an FP8 weight keeps its own, from the optimizer) and the output gradient
    (E5M2 with HYBRID). Every rank sees the same hits (the amaxes are reduced first). Current
    scaling takes the scale from the tensor being cast: it cannot overflow.

An open monitor is held by the layers it watches (``Linear._fp8_monitors``), not by a module-level
list: the amax reduction asks the layers it updates. Nothing is observed while no monitor is
open, so the reduction costs what it did before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fp8shard.nn.linear import Linear

OPERANDS = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class Fp8Overflow:
    """One layer operand that saturated (or saw a non-finite amax) since the last poll."""

    layer: str
    operand: str
    """input, weight or grad_output."""
    amax: float
    """The largest amax seen (of the worst reduction)."""
    scale: float
    """The scale the cast used then."""
    fmt_max: float
    """The format's largest finite value (448 for E4M3, 57344 for E5M2)."""
    count: int
    """How many amax reductions since the last poll saw it (beyond the factor, or non-finite)."""
    nonfinite: bool = False
    """The amax was NaN or inf (rather than finite and too large)."""

    @property
    def excess(self) -> float:
        """``amax * scale / fmt_max``: how far beyond the representable range (inf: non-finite)."""
        return float("inf") if self.nonfinite else self.amax * self.scale / self.fmt_max

    def message(self) -> str:
        if self.nonfinite:
            return (f"fp8 non-finite amax in layer '{self.layer}' {self.operand}: amax {self.amax} "
                    f"(the scale {self.scale:.4g} is kept; {self.count} reduction(s))")
        return (f"fp8 overflow in layer '{self.layer}' {self.operand}: amax {self.amax:.4g} > "
                f"{self.fmt_max:g} / scale {self.scale:.4g} = {self.fmt_max / self.scale:.4g} "
                f"(saturated; {self.count} reduction(s)): values up to {_times(self.excess)}x the largest "
                f"this cast could represent at its scale from earlier steps were clipped to it")


def _times(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


OVERFLOW_NOTE = (
    "an FP8 overflow means a tensor grew faster than delayed scaling followed: each cast's scale "
    "comes from the amaxes of earlier steps, so this step's largest values were clipped to the "
    "largest FP8 number at that scale, and the scale catches up at the next step. The size of the "
    "amax does not matter (gradients of 1e-4 are normal), only its ratio to what the scale allows. "
    "Now and then, e.g. in the first steps while the gradients grow, it is harmless; if a layer "
    "overflows step after step, try model.fp8_margin=1 or model.fp8_recipe=current "
    "(trainer.fp8_overflow_factor sets which excess is reported; docs/reliability.md)")
"""Said once per run, with the first overflow reported ([Note: overflow check])."""


class _Accumulator:
    """Device-side hits of one set of layers (one per distinct set reduced together)."""

    def __init__(self, names: list[str], fmt_max: torch.Tensor, factor: float) -> None:
        self.names, self.fmt_max, self.factor = names, fmt_max, factor

        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(fmt_max.shape, dtype=dtype, device=fmt_max.device)

        self.saturated, self.over, self.nonfinite = zeros(torch.int32), zeros(torch.int32), zeros(torch.int32)
        self.ratio = zeros(torch.float32)  # the worst amax * scale / fmt.max so far
        self.amax, self.scale = zeros(torch.float32), zeros(torch.float32)
        self.bad_amax = zeros(torch.float32)

    def observe(self, packed: torch.Tensor, scales: torch.Tensor) -> None:
        amax = packed.float()
        finite = torch.isfinite(amax)
        ratio = torch.where(finite, amax * scales / self.fmt_max, torch.zeros_like(amax))
        self.saturated += (ratio > 1.0).int()
        self.over += (ratio > self.factor).int()
        self.nonfinite += (~finite).int()
        worse = ratio > self.ratio
        self.ratio = torch.where(worse, ratio, self.ratio)
        self.amax = torch.where(worse, amax, self.amax)
        self.scale = torch.where(worse | ~finite, scales, self.scale)
        self.bad_amax = torch.where(finite, self.bad_amax, amax)

    def counts(self) -> torch.Tensor:
        """[operands to report, saturated operands] (a (layer, operand) counts once)."""
        return torch.stack([(self.over > 0).sum() + (self.nonfinite > 0).sum(), (self.saturated > 0).sum()])

    def drain(self) -> list[Fp8Overflow]:
        over, nonfinite = self.over.tolist(), self.nonfinite.tolist()
        amax, scale, bad, fmt = (t.tolist() for t in (self.amax, self.scale, self.bad_amax, self.fmt_max))
        out = []
        for i, name in enumerate(self.names):
            for j, operand in enumerate(OPERANDS):
                if nonfinite[i][j]:
                    out.append(Fp8Overflow(name, operand, bad[i][j], scale[i][j], fmt[i][j],
                                           nonfinite[i][j], nonfinite=True))
                if over[i][j]:
                    out.append(Fp8Overflow(name, operand, amax[i][j], scale[i][j], fmt[i][j], over[i][j]))
        self.reset()
        return out

    def reset(self) -> None:
        for t in (self.saturated, self.over, self.nonfinite, self.ratio, self.amax, self.scale,
                  self.bad_amax):
            t.zero_()


class OverflowMonitor:
    """Watches the FP8 layers of ``model`` for saturated casts ([Note: overflow check]).

    ``with OverflowMonitor(model) as mon:`` (or ``open()`` / ``close()``); ``mon.poll()`` returns
    the :class:`Fp8Overflow` records seen since the last poll, naming layers as
    ``model.named_modules()`` does. Layers of other models are ignored. ``factor``: report an
    operand whose amax exceeds ``fmt.max / scale`` by more than this (1: every saturated cast).
    """

    def __init__(self, model: nn.Module, factor: float = 1.0) -> None:
        if not factor >= 1.0:
            raise ValueError(f"OverflowMonitor(factor=...) must be >= 1, got {factor}")
        self.factor = float(factor)
        self.names = {id(m): name for name, m in model.named_modules()}
        self._layers = [m for m in model.modules() if isinstance(m, Linear)]
        self._acc: dict[tuple[int, ...], tuple[_Accumulator, list[int], tuple[Any, ...]]] = {}
        self._retired: list[_Accumulator] = []
        self.overflows = 0
        """Overflows beyond the factor reported by poll() so far: one per (poll, layer, operand)."""
        self.nonfinite = 0
        """Non-finite amaxes reported by poll() so far: one per (poll, layer, operand)."""
        self.saturated = 0
        """Saturated casts counted by poll() so far (any excess): one per (poll, layer, operand)."""
        self.explained = False
        """Whether OVERFLOW_NOTE was handed out (``note_for``)."""

    def open(self) -> OverflowMonitor:
        for layer in self._layers:
            if self not in layer._fp8_monitors:
                layer._fp8_monitors = (*layer._fp8_monitors, self)
        return self

    def close(self) -> None:
        for layer in self._layers:
            layer._fp8_monitors = tuple(m for m in layer._fp8_monitors if m is not self)

    def __enter__(self) -> OverflowMonitor:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _observe(self, layers: list[Any], packed: torch.Tensor) -> None:
        key = tuple(id(layer) for layer in layers)
        formats = tuple(layer._amax_state.recipe.fp8_format for layer in layers)
        entry = self._acc.get(key)
        if entry is None or entry[2] != formats:
            if entry is not None:  # a new recipe: keep the old hits until the next poll
                self._retired.append(entry[0])
            mine = [i for i, layer in enumerate(layers) if id(layer) in self.names]
            rows = [[formats[i].fwd.max, formats[i].fwd.max, formats[i].bwd.max] for i in mine]
            fmt_max = torch.tensor(rows, dtype=torch.float32, device=packed.device).reshape(len(mine), 3)
            acc = _Accumulator([self.names[id(layers[i])] for i in mine], fmt_max, self.factor)
            entry = (acc, mine, formats)
            self._acc[key] = entry
        acc, mine, _ = entry
        if not mine:
            return
        if len(mine) == len(layers):
            amaxes, scales = packed, torch.stack([layer.fp8_scale for layer in layers])
        else:
            idx = torch.tensor(mine, device=packed.device)
            amaxes, scales = packed.index_select(0, idx), torch.stack([layers[i].fp8_scale for i in mine])
        acc.observe(amaxes, scales.float())

    def note_for(self, events: list[Fp8Overflow]) -> str | None:
        """OVERFLOW_NOTE the first time ``events`` hold an overflow, else None."""
        if self.explained or all(o.nonfinite for o in events):
            return None
        self.explained = True
        return OVERFLOW_NOTE

    def poll(self) -> list[Fp8Overflow]:
        """The overflows since the last poll (then forgotten), worst first; one host sync when
        there are none."""
        accs = [a for a, _, _ in self._acc.values()] + self._retired
        if not accs:
            return []
        report, saturated = (int(v) for v in torch.stack([a.counts() for a in accs]).sum(0).tolist())
        self.saturated += saturated
        if report == 0:
            for a in accs:
                a.reset()
            self._retired = []
            return []
        out = sorted((o for a in accs for o in a.drain()), key=lambda o: -o.excess)
        self._retired = []
        self.overflows += sum(1 for o in out if not o.nonfinite)
        self.nonfinite += sum(1 for o in out if o.nonfinite)
        return out


def observe(layers: list[Any], packed: torch.Tensor) -> None:
    """Called by the amax reduction with the reduced amaxes of ``layers`` ([n, 3]) before their
    scales are updated; a no-op unless a monitor watching one of them is open."""
    monitors = dict.fromkeys(m for layer in layers for m in layer._fp8_monitors)  # once each, in order
    for monitor in monitors:
        monitor._observe(layers, packed)

"""``fp8_model_init``: build fp8shard layers whose weights are stored as FP8 from the start.

Transformer Engine's first quantization used scale 1.0 and its optimizer started the FP32
master from the dequantized bytes, which hurt early convergence (TransformerEngine 1121/1544).
Here the first quantization takes its scale from the initial weight's amax (current scaling),
and ``preserve_high_precision_init_val=True`` keeps the initial values on CPU
(``Float8Tensor.get_high_precision_init_val()``) so the optimizer can start its master from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class ModelInitState:
    """What the innermost ``fp8_model_init`` asks of the layers built inside it."""

    enabled: bool
    preserve_high_precision_init_val: bool
    recipe: object = None
    """The weights' recipe: None or per-tensor, one scale; rowwise or blockwise, one per tile."""


_stack: list[ModelInitState] = []


@contextlib.contextmanager
def fp8_model_init(
    enabled: bool = True, preserve_high_precision_init_val: bool = False, recipe: object = None,
) -> Iterator[None]:
    """Every ``fp8shard.nn.Linear`` built inside stores its weight as an E4M3 ``Float8Tensor``.

    One byte per weight element; the forward GEMM uses those bytes and their ``scale_inv``
    directly. Norms, embeddings and biases stay in high precision. ``recipe`` (a recipe or its
    name): ``rowwise`` / ``blockwise`` store one scale per row / per 128x128 block, for layers
    computing under that recipe; None or a per-tensor recipe, one scale per weight.
    """
    for name, value in (("enabled", enabled),
                        ("preserve_high_precision_init_val", preserve_high_precision_init_val)):
        if not isinstance(value, bool):
            raise TypeError(f"fp8_model_init({name}=...) takes a bool, got {type(value).__name__}")
    if recipe is not None:
        from fp8shard.fp8.quantizer import parse_recipe

        recipe = parse_recipe(recipe)
    _stack.append(ModelInitState(enabled, preserve_high_precision_init_val, recipe))
    try:
        yield
    finally:
        _stack.pop()


def current_model_init() -> ModelInitState | None:
    """The innermost enabled ``fp8_model_init``'s state, or None."""
    if _stack and _stack[-1].enabled:
        return _stack[-1]
    return None

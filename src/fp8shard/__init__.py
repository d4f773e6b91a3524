"""fp8shard: train transformers whose weights live in FP8, with a sharded optimizer.

See docs/design.md for the data flow and the [Note: ...] conventions cited in the code.
"""

from fp8shard.fp8 import (
    CurrentScaling,
    DelayedScaling,
    Float8Tensor,
    Fp8Format,
    RecipeFormat,
)

__version__ = "0.1.0"

__all__ = [
    "CurrentScaling", "DelayedScaling", "Float8Tensor", "Fp8Format", "RecipeFormat", "__version__",
]

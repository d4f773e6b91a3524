"""fp8shard: train transformers whose weights live in FP8, with a sharded optimizer.

See docs/design.md for the data flow and the [Note: ...] conventions cited in the code.
"""

from fp8shard import nn
from fp8shard._triton import get_triton, set_triton
from fp8shard.fp8 import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Float8Tensor,
    Fp8Format,
    RecipeFormat,
    RowwiseScaling,
    get_fp8_gemm,
    set_fp8_gemm,
)
from fp8shard.nn import AmaxSync, convert_to_fp8, fp8_autocast, fp8_model_init

__version__ = "0.1.0"

__all__ = [
    "AmaxSync", "convert_to_fp8", "fp8_autocast", "fp8_model_init", "nn",
    "BlockwiseScaling", "CurrentScaling", "DelayedScaling", "Float8Tensor", "Fp8Format", "RecipeFormat",
    "RowwiseScaling", "__version__", "get_fp8_gemm", "set_fp8_gemm", "get_triton", "set_triton",
]

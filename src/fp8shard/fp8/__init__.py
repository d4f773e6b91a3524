"""FP8 formats, scaling and the Float8Tensor."""

from fp8shard.fp8 import ops as _ops  # noqa: F401  (registers the dispatch table)
from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.gemm import get_fp8_gemm, set_fp8_gemm
from fp8shard.fp8.quantizer import AmaxHistory, amax, cast_from_fp8, cast_to_fp8, scale_from_amax
from fp8shard.fp8.scaling import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Recipe,
    RecipeFormat,
    RowwiseScaling,
)
from fp8shard.fp8.tensor import Float8Tensor

__all__ = [
    "AmaxHistory", "BlockwiseScaling", "CurrentScaling", "DelayedScaling", "Float8Tensor", "Fp8Format",
    "Recipe", "RecipeFormat", "RowwiseScaling", "amax", "cast_from_fp8", "cast_to_fp8", "get_fp8_gemm",
    "scale_from_amax", "set_fp8_gemm",
]

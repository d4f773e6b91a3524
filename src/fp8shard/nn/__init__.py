"""FP8 layers: ``Linear``, the contexts that make layers compute or store in FP8, and
``AmaxSync``, the once-per-backward delayed-scaling amax reduction the training loop calls.

See docs/nn.md for the recipes, the amax reduction and ``convert_to_fp8``.
"""

from fp8shard.nn.amax_sync import AmaxSync, reduce_and_update_amaxes
from fp8shard.nn.autocast import fp8_autocast
from fp8shard.nn.convert import convert_to_fp8, default_module_filter
from fp8shard.nn.gemm_filter import fp8_gemm_pays, select_fp8_layers
from fp8shard.nn.linear import Linear, prepare_delayed_scaling
from fp8shard.nn.model_init import fp8_model_init

__all__ = [
    "AmaxSync", "Linear", "convert_to_fp8", "default_module_filter", "fp8_autocast", "fp8_gemm_pays",
    "fp8_model_init", "prepare_delayed_scaling", "reduce_and_update_amaxes", "select_fp8_layers",
]

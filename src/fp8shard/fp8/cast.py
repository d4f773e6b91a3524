"""The FP8 cast itself: scale, saturate, round to nearest even. See [Note: scale].

Written in ``fp8/quantizer.py``, beside the scale rule and the quantizers that cast through it;
its names stay importable from here.
"""

from fp8shard.fp8.quantizer import cast_from_fp8, cast_to_fp8

__all__ = ["cast_from_fp8", "cast_to_fp8"]

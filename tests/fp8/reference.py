"""An independent reference for FP8 rounding: nearest representable value, ties to even.

Built from the table of all 256 byte patterns, so it shares no code with the cast under test.
"""

from __future__ import annotations

import numpy as np
import torch

import fp8shard as fs


def _positive_table(fmt: fs.Fp8Format) -> tuple[np.ndarray, np.ndarray]:
    codes = torch.arange(128, dtype=torch.uint8)  # sign bit clear
    values = codes.view(fmt.torch_dtype).double().numpy()
    keep = np.isfinite(values)
    return values[keep], codes.numpy()[keep]


def reference_cast(x: np.ndarray, fmt: fs.Fp8Format) -> np.ndarray:
    """float64 values of ``saturate(round_nearest_even(x))`` in ``fmt``; NaN stays NaN."""
    values, codes = _positive_table(fmt)
    mag = np.abs(x)
    out = np.empty_like(mag)
    nan = np.isnan(mag)
    m = np.where(nan, 0.0, np.minimum(mag, fmt.max))
    hi = np.clip(np.searchsorted(values, m, side="left"), 0, len(values) - 1)
    lo = np.clip(hi - 1, 0, len(values) - 1)
    d_lo, d_hi = m - values[lo], values[hi] - m
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, values[hi], values[lo])
    out = np.where(m == values[hi], values[hi], out)
    out = np.copysign(out, x)
    out[nan] = np.nan
    return out

"""Numerics metrics used by tests and benchmarks."""

from __future__ import annotations

import math

import torch


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||ref - approx||), in fp64."""
    ref64, approx64 = ref.detach().double(), approx.detach().double()
    noise = torch.linalg.vector_norm(ref64 - approx64).item()
    signal = torch.linalg.vector_norm(ref64).item()
    if noise == 0:
        return math.inf
    return 20.0 * math.log10(signal / noise)

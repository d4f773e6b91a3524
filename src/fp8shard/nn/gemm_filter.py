"""Which layers compute in FP8: ``fp8_gemm_pays`` (the shape rule) and ``select_fp8_layers``.

[Note: FP8 layer filter]
    An FP8 GEMM is faster than a bf16 one, but FP8 compute also costs passes that bf16 does not
    make: the amax and the cast of the input and of the output gradient, with their transposed
    copies, and the transposed weight bytes. They grow with tokens x (in + out) where the GEMM
    saves time in proportion to tokens x in x out, so below some layer width the layer is slower
    in FP8 than in bf16 (`benchmarks/bench_linear.py --shapes` measures it per shape on a GPU;
    torchao's and torchtitan's ``auto_filter_small_kn`` skip such layers for the same reason).

    A ``fs.nn.Linear`` with ``fp8_compute = False`` computes in the autocast's precision from
    its weight. An FP8-stored weight stays stored, sharded, gathered and written by the
    optimizer as FP8 bytes with its scale; the layer dequantizes it on the fly, in the forward
    and again in the backward (``_LinearFromFp8Weight`` in nn/linear.py: one read of 1 B and
    one write of 2 B per weight each time), so the backward keeps the weight's bytes, not a
    16-bit copy of every such layer's weight. Such a layer has no delayed-scaling state and
    ``AmaxSync`` skips it.

    ``model.fp8_layers=auto`` (the training command's default) applies ``fp8_gemm_pays`` to the
    block projections on a CUDA device; on the CPU every layer computes in FP8 (there the FP8
    GEMMs are emulated or run by oneDNN: CPU runs are for the numerics, not for speed).
    ``all`` computes every layer in FP8, wherever it runs.
"""

from __future__ import annotations

import torch

from fp8shard.nn.linear import Linear

FP8_LAYER_POLICIES = ("auto", "all")

# Where FP8 compute pays on an H100/H200 at the training command's batch sizes (16k tokens a
# step): measured per layer shape, compiled, forward + backward, FP8 weights and current scaling
# against bf16 nn.Linear (`bench_linear.py --shapes`, H100, 2026-12-07, docs/performance.md):
# 2048x6144 1.11x, 2048x8192 1.08x, 8192x2048 1.19x; 2048x2048 0.66x, 1536x1536 0.48x, GPT-2
# small's four projections 0.50-0.61x. A layer alone pays a fixed launch cost that a whole
# compiled model hides, so the threshold is set where the whole-model measurements stand: at
# 2^22 weights, GPT-2 small's layers (at most 2.4M) compute in bf16 (measured faster in the
# whole 125M step) and the 1.3B GPT's 2048x2048 (4.2M) stays in FP8 with its other layers: in
# place that layer pays (1.17x the compiled reference with it in FP8, 1.15x without; H100,
# 2026-12-07, docs/performance.md section 7).
MIN_FP8_FEATURES = 1024
MIN_FP8_WEIGHT_ELEMENTS = 2 ** 22


def fp8_gemm_pays(in_features: int, out_features: int, min_weights: int | None = None) -> bool:
    """Whether a linear layer of this shape trains faster in FP8 than in bf16 on an H100/H200
    (both widths at least ``MIN_FP8_FEATURES`` and at least ``min_weights`` weights, by default
    ``MIN_FP8_WEIGHT_ELEMENTS``; [Note: FP8 layer filter])."""
    least = MIN_FP8_WEIGHT_ELEMENTS if min_weights is None else min_weights
    return min(in_features, out_features) >= MIN_FP8_FEATURES and in_features * out_features >= least


def select_fp8_layers(model: torch.nn.Module, policy: str = "auto",
                      device: torch.device | str | None = None,
                      min_weights: int | None = None) -> tuple[int, int]:
    """Set ``fp8_compute`` on every ``fs.nn.Linear`` of ``model`` by ``policy``: ``all`` (every
    layer computes in FP8) or ``auto`` (on CUDA, the layers ``fp8_gemm_pays`` keeps, with its
    ``min_weights``; elsewhere all). ``device`` defaults to the model's first parameter's.
    Returns (layers computing in FP8, all ``fs.nn.Linear`` layers)."""
    if policy not in FP8_LAYER_POLICIES:
        raise ValueError(f"unknown FP8 layer policy {policy!r}; choose one of "
                         f"{', '.join(FP8_LAYER_POLICIES)} (model.fp8_layers)")
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    filtered = policy == "auto" and torch.device(device).type == "cuda"
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.fp8_compute = not filtered or fp8_gemm_pays(layer.in_features, layer.out_features,
                                                              min_weights)
    return count_fp8_layers(model)


def count_fp8_layers(model: torch.nn.Module) -> tuple[int, int]:
    """(``fs.nn.Linear`` layers of ``model`` with ``fp8_compute`` set, all of them)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    return sum(layer.fp8_compute for layer in layers), len(layers)

"""Wire bytes per weight of the FP8 parameter all-gather, per scaling recipe, counted from the
optimizer's own layout (pure arithmetic: [Note: shard layout], [Note: tiled weight casts]).

    python benchmarks/bench_tiled_wire.py [--out FILE.json]

Counted as ``DistributedFusedAdam.comm_report`` counts them (the full buffer per rank): the
all-gather of every FP8 bucket (1 byte per element, padding included) plus the packed
all-reduce of the weights' amaxes (4 bytes per slot: one per weight, per row, or per 128x128
block), over the number of FP8 weight elements. GPT block weights (qkv, proj, fc1, fc2),
25 MiB buckets of bf16 gradients (``bucket_cap_mb`` default), alignment 16.
"""

from __future__ import annotations

import argparse
import json
import math

from fp8shard.optim.layout import ParamSpec, build_layout

SHAPES = {  # name: (hidden, ffn, layers)
    "1.3B-like (2048, 8192, x24)": (2048, 8192, 24),
    "tiny (64, 256, x2; tests/train TINY)": (64, 256, 2),
}
BUCKET_NUMEL = int(25 * 2**20 / 2)
RECIPES = ("tensorwise", "rowwise", "blockwise")


def weights(hidden: int, ffn: int, layers: int) -> list[tuple[int, int]]:
    block = ((3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn))  # qkv, proj, fc1, fc2
    return [s for _ in range(layers) for s in block]


def unit_and_slots(recipe: str, rows: int, cols: int) -> tuple[int, int]:
    """What ``optim.buffers.shard_unit`` and the weight scaler give a weight of this shape."""
    if recipe == "rowwise":
        return cols, rows
    if recipe == "blockwise":
        return min(128, rows) * cols, math.ceil(rows / 128) * math.ceil(cols / 128)
    return 1, 1


def bytes_per_weight(recipe: str, shapes: list[tuple[int, int]], world_size: int) -> float:
    specs, slots = [], 0
    for i, (rows, cols) in enumerate(reversed(shapes)):  # backward order, as the optimizer lays them
        unit, k = unit_and_slots(recipe, rows, cols)
        specs.append(ParamSpec(i, rows * cols, "fp8", unit))
        slots += k
    gathered = sum(r.numel for r in build_layout(specs, world_size, BUCKET_NUMEL, 16))
    return (gathered + 4 * slots) / sum(r * c for r, c in shapes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the table as JSON")
    args = ap.parse_args()
    rows = []
    print(f"{'shapes':40} {'ranks':>5} {'tensorwise':>11} {'rowwise':>8} {'blockwise':>10}")
    for name, dims in SHAPES.items():
        for world in (1, 2, 8):
            row = {r: bytes_per_weight(r, weights(*dims), world) for r in RECIPES}
            rows.append({"shapes": name, "world_size": world, **row})
            t, r, b = (row[k] for k in RECIPES)
            print(f"{name:40} {world:>5} {t:>11.4f} {r:>8.4f} {b:>10.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bytes_per_weight": rows, "bucket_numel": BUCKET_NUMEL}, f, indent=1)


if __name__ == "__main__":
    main()

"""Float8Tensor under FSDP2 (``fully_shard``): the all-gather moves FP8 bytes, never bf16.

[Note: FSDP2 extension]
    FSDP2 shards each parameter on dim 0 and keeps this rank's rows as the local tensor of a
    DTensor; for a Float8Tensor weight that local tensor is itself a Float8Tensor (the ops it
    needs to stay FP8 -- ``split``, ``slice``, ``new_zeros``, ``new_empty`` -- are in
    ``fp8/ops.py``), so a rank holds 1 byte per element of its shard plus the fp32 scale.
    Before an all-gather FSDP2 asks the local tensor for its all-gather inputs
    (``fsdp_pre_all_gather``): we hand it the padded shard's bytes as ``uint8`` (gloo has no
    float8 dtype; NCCL takes uint8 as well) and the scale as metadata. The scale is the same on
    every rank ([Note: weight scaling]: the optimizer derives it from the global amax), so it is
    not gathered. After the all-gather FSDP2 hands back the gathered ``uint8`` buffer
    (``fsdp_post_all_gather``) and we wrap it as the unsharded Float8Tensor: no copy, no
    high-precision round trip. On later all-gathers FSDP2 passes the unsharded tensor it got the
    first time as ``out``: the bytes are already in its storage, only the scale is refreshed and
    the cached transpose dropped. A rowwise or blockwise weight gathers its scale grid rows as
    a second input ([Note: FSDP2 tiled weights]); per-tensor weights keep one input.

    Torch versions: torch >= 2.5 (2.11 and 2.13 included) call
    ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` and expect the
    inputs padded to the padded shard size on ranks with fewer rows; torch 2.4 called it with
    ``mesh`` alone. ``fsdp_pre_all_gather`` below takes the later arguments as optional, so it
    serves both: FSDP2 counts the parameters of the bound method (1 or 5) to decide which form
    to call, and the padded size is derived from the bytes' storage when ``outer_size`` is
    absent. ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` is the same in
    every version that has the extension.

[Note: FSDP2 tiled weights]
    A rowwise or blockwise weight (``Float8Tensor.block``) has a scale per row or per 128x128
    block, and the scale grid's rows run along the weight's rows: FSDP2's dim-0 cut gives each
    rank its rows of the bytes and its rows of the grid ([Note: FP8 tiled slices]), as long as
    the cut falls on tile rows -- always for rowwise, on 128-row bands for blockwise. The
    all-gather then moves two inputs per weight: the bytes as ``uint8`` and the grid rows
    (fp32; FSDP2 packs inputs of several dtypes into one ``uint8`` buffer, so it stays one
    collective). Each rank's grid rows are the padded shard's, so the gathered grid is the
    whole grid in order; ``post_all_gather`` wraps the gathered bytes and grid (trimmed to the
    weight's rows) as the unsharded Float8Tensor, no copy; on later gathers both are already in
    ``out``'s storage, and only the cached transpose is dropped. Bytes on the wire per weight:
    1 + 4 / cols (rowwise), 1 + 4 / 16384 (blockwise with 128-multiple columns).
    Two limits, refused up front (``check_tiled_sharding``): the rows must split evenly over
    the shard ranks (FSDP2 requires every all-gather input of an unevenly cut parameter to
    have the padded shard's shape, which the grid rows cannot have), and for blockwise each
    rank's rows must be whole 128-row bands (a band cut between ranks would need one scale from
    two ranks' rows).
    At a shard world size of 1 (one GPU, or HSDP with one rank per shard group) FSDP2 (torch
    2.11, 2.13) gathers nothing: it copies the *first* all-gather input alone into the unsharded
    buffer and hands ``post_all_gather`` that one output (seen on an H100, 2026-12-07). There
    the bytes and the grid travel as one ``uint8`` input instead: the bytes, zero padding to a
    multiple of 4 bytes, then the grid's fp32 bytes; ``post_all_gather`` views both out of it,
    no copy, and later copies land in the same storage as before.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from fp8shard.fp8.formats import Fp8Format

if TYPE_CHECKING:
    from fp8shard.fp8.tensor import Float8Tensor


def _padded_rows(t: Float8Tensor, mesh: Any, outer_size: torch.Size | None) -> int:
    """Rows of the padded shard FSDP2 all-gathers: ``ceil(global rows / shard world size)``."""
    if outer_size is not None and len(outer_size) > 0:
        return math.ceil(outer_size[0] / mesh.size())
    # torch 2.4's one-argument call: the shard is a narrow of the padded buffer FSDP2 allocated.
    row = max(1, math.prod(t.shape[1:]))
    return t._data.untyped_storage().nbytes() // row


def fitting_shard_worlds(shapes: list[tuple[int, ...]], block: tuple[int, int], most: int = 128) -> list[int]:
    """Shard world sizes (2..``most``) that cut every weight of ``shapes`` into whole tiles."""
    br = int(block[0])
    return [w for w in range(2, most + 1) if all(r % w == 0 and (r // w) % br == 0 for r, *_ in shapes)]


def check_tiled_sharding(shape: tuple[int, ...], block: tuple[int, int], shard_world: int,
                         name: str = "", fits: list[int] | None = None) -> None:
    """Refuse a rowwise or blockwise weight FSDP2 cannot cut over ``shard_world`` ranks
    ([Note: FSDP2 tiled weights]), naming the shapes and the fixes; ``fits``: the shard world
    sizes that would do for the whole model (default: for this weight)."""
    rows, br = int(shape[0]), int(block[0])
    if shard_world <= 1:
        return
    chunk = -(-rows // shard_world)
    even = rows % shard_world == 0
    if even and chunk % br == 0:
        return
    kind = "rowwise" if br == 1 else f"blockwise ({br}x{block[1]} blocks)"
    what = f"{kind} FP8 weight {name + ' ' if name else ''}of shape {tuple(shape)}"
    ok = fitting_shard_worlds([tuple(shape)], block) if fits is None else fits
    sizes = f"shard world sizes that fit: {', '.join(map(str, ok[:8]))}" if ok else "no size > 1 fits"
    if not even:
        why = (f"FSDP2 over {shard_world} shard ranks cuts its {rows} rows unevenly ({chunk} per rank, "
               "fewer on the last); FSDP2 gathers an unevenly cut parameter only if every all-gather "
               "input has the padded shard's shape, which the scale rows beside the bytes cannot have")
    else:
        why = (f"FSDP2 over {shard_world} shard ranks gives each rank {chunk} rows, not a multiple of "
               f"{br}: a {br}-row band of blocks would be cut between ranks")
    raise ValueError(f"{what}: {why}. Shard it over a number of ranks that divides the rows into whole "
                     f"tiles ({sizes}; with HSDP, trainer.hsdp_replicate sets the replicas), or train "
                     "with trainer.strategy=flat, or use per-tensor FP8 weights (model.fp8_recipe=current)")


def pre_all_gather(t: Float8Tensor, mesh: Any, outer_size: torch.Size | None = None
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
    """(all-gather inputs, metadata): the padded shard's bytes as ``uint8`` and the scale; for
    a tiled weight, its bytes and its rows of the scale grid ([Note: FSDP2 tiled weights])."""
    data = t._data
    if t._block is not None:
        rows = outer_size[0] if outer_size is not None and len(outer_size) else mesh.size() * data.shape[0]
        check_tiled_sharding((rows, *t.tile_shape[1:]), t._block, mesh.size())
        grid = t._scale_inv.view(-1, t._scale_inv.shape[-1])
        if mesh.size() == 1:  # FSDP2 copies the first input alone ([Note: FSDP2 tiled weights])
            packed, layout = _pack_bytes_and_grid(data.view(torch.uint8), grid)
            return (packed,), (None, t._fp8_format, t._block, int(rows), layout)
        return (data.view(torch.uint8), grid), (None, t._fp8_format, t._block, int(rows), None)
    rows = _padded_rows(t, mesh, outer_size)
    padded_shape = (rows, *data.shape[1:])
    if tuple(data.shape) != padded_shape:
        # This rank's shard is shorter than the padded size (uneven sharding, the last ranks).
        # FSDP2 keeps it as a narrow of a padded buffer: view the whole buffer when it is there
        # (no copy), else pad a copy (the padding is never read after the gather).
        stride = torch._prims_common.make_contiguous_strides_for(padded_shape)
        need = data.storage_offset() + math.prod(padded_shape)
        if data.is_contiguous() and data.untyped_storage().nbytes() >= need:
            data = data.as_strided(padded_shape, stride, data.storage_offset())
        else:
            padded = data.new_zeros(padded_shape)
            padded[:data.shape[0]].copy_(data)
            data = padded
    return (data.view(torch.uint8),), (t._scale_inv, t._fp8_format)


def post_all_gather(t: Float8Tensor, outputs: tuple[torch.Tensor, ...], metadata: tuple[Any, ...],
                    param_dtype: torch.dtype, out: Float8Tensor | None = None
                    ) -> tuple[Float8Tensor, tuple[torch.Tensor, ...]] | None:
    """The unsharded Float8Tensor over the gathered bytes (first call), or refresh ``out``."""
    from fp8shard.fp8.tensor import Float8Tensor

    if t._block is not None:
        return _post_all_gather_tiled(outputs, metadata, param_dtype, t.dtype, out)
    (gathered,) = outputs
    scale_inv, fmt = metadata
    fmt = Fp8Format.parse(fmt)
    if out is not None:
        # The gathered bytes already sit in out's storage (FSDP2 re-allocates the same buffer).
        # A new scale tensor, not copy_: the backward of the forward that used the old one may
        # have saved it (the re-gather before backward would bump its version).
        out._scale_inv = scale_inv.detach().clone()
        out.mark_bytes_changed()  # drops the cached transpose of the previous bytes
        return None
    data = gathered.view(fmt.torch_dtype)  # 1-D [padded rows x row] bytes, no copy
    dtype = param_dtype if param_dtype is not None and param_dtype.is_floating_point else t.dtype
    # A scale tensor of its own: the unsharded weight outlives this step's local scale updates
    # only through the copy above, so the GEMMs always read the scale that came with the bytes.
    unsharded = Float8Tensor(data, scale_inv.detach().clone(), fmt, dtype)
    return unsharded, (data,)


def _post_all_gather_tiled(outputs: tuple[torch.Tensor, ...], metadata: tuple[Any, ...],
                           param_dtype: torch.dtype, own_dtype: torch.dtype, out: Float8Tensor | None
                           ) -> tuple[Float8Tensor, tuple[torch.Tensor, ...]] | None:
    """The unsharded tiled Float8Tensor over the gathered bytes and grid rows (first call), or
    ``out`` told its bytes and grid changed (they are already in its storage)."""
    from fp8shard.fp8.tensor import Float8Tensor

    _, fmt, block, rows, layout = metadata
    if layout is not None:  # one rank: bytes and grid packed in one uint8 input
        gathered, grid = _unpack_bytes_and_grid(outputs[0], layout)
    else:  # [ranks x padded rows, cols] uint8, [ranks x grid rows, grid cols] fp32
        gathered, grid = outputs
    if out is not None:
        out.mark_bytes_changed()  # drops the cached transpose of the previous bytes
        return None
    fmt = Fp8Format.parse(fmt)
    data = gathered.view(fmt.torch_dtype)[:rows]  # a view: no copy
    scale_inv = grid[:-(-rows // block[0])]
    dtype = param_dtype if param_dtype is not None and param_dtype.is_floating_point else own_dtype
    inner = (outputs[0],) if layout is not None else (gathered, grid)
    return Float8Tensor(data, scale_inv, fmt, dtype, block=block), inner


def _pack_bytes_and_grid(data: torch.Tensor, grid: torch.Tensor
                         ) -> tuple[torch.Tensor, tuple[tuple[int, ...], tuple[int, ...], int]]:
    """One 1-D uint8 tensor: ``data``'s bytes, zeros up to a multiple of 4, ``grid``'s fp32 bytes;
    and the layout ``_unpack_bytes_and_grid`` needs (shapes, the grid's byte offset)."""
    offset = -(-data.numel() // 4) * 4
    pad = data.new_zeros(offset - data.numel())
    packed = torch.cat([data.reshape(-1), pad, grid.reshape(-1).contiguous().view(torch.uint8)])
    return packed, (tuple(data.shape), tuple(grid.shape), offset)


def _unpack_bytes_and_grid(packed: torch.Tensor, layout: tuple[tuple[int, ...], tuple[int, ...], int]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the bytes (uint8) and the grid (fp32) inside ``packed`` (no copy)."""
    data_shape, grid_shape, offset = layout
    flat = packed.reshape(-1)
    data = flat[:math.prod(data_shape)].view(data_shape)
    grid = flat[offset:offset + 4 * math.prod(grid_shape)].view(torch.float32).view(grid_shape)
    return data, grid

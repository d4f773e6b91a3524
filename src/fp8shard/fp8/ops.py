"""What each aten op does to a Float8Tensor (the ``__torch_dispatch__`` table).

Three classes of op, see [Note: Float8Tensor]:
  * listed here with ``@implements``: keep FP8 (views, detach, clone, copy_, device moves);
  * in-place (the schema writes an argument): dequantize -> apply -> re-quantize in place;
  * everything else: run on the dequantized values, return plain tensors (the fallback).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from fp8shard.fp8.tensor import Float8Tensor

aten = torch.ops.aten
_TABLE: dict[Any, Callable[..., Any]] = {}


def implements(ops: list[Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _TABLE[op] = fn
        return fn

    return register


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    handler = _TABLE.get(func)
    if handler is not None:
        return handler(func, args, kwargs)
    if _mutated_arg_indices(func):
        return _inplace(func, args, kwargs)
    return _fallback(func, args, kwargs)


def _unwrap(x: Any) -> Any:
    return x.dequantize() if isinstance(x, Float8Tensor) else x


def _fallback(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))


def _mutated_arg_indices(func: Any) -> list[int]:
    cache = _MUTATED.get(func)
    if cache is None:
        cache = [
            i for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        _MUTATED[func] = cache
    return cache


_MUTATED: dict[Any, list[int]] = {}


def _inplace(func: Any, args: tuple, kwargs: dict) -> Any:
    """Dequantize, apply the op to high-precision copies, re-quantize into the same bytes."""
    schema_args = func._schema.arguments
    targets: dict[str, Float8Tensor] = {}
    hp_args = list(tree_map(_unwrap, args))
    hp_kwargs = dict(tree_map(_unwrap, kwargs))
    for i in _mutated_arg_indices(func):
        name = schema_args[i].name
        original = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(original, Float8Tensor):
            if is_slice(original):
                _refuse_slice_write(original, f"{func}")
            targets[name] = original
    out = func(*hp_args, **hp_kwargs)
    for i, a in enumerate(schema_args):
        f8 = targets.get(a.name)
        if f8 is None:
            continue
        hp = hp_args[i] if i < len(hp_args) else hp_kwargs[a.name]
        _keep_hp_init_val(f8, hp)
        f8.quantize_(hp)
    if isinstance(out, torch.Tensor) and len(targets) == 1:
        return next(iter(targets.values()))
    return out


@implements([aten.detach.default, aten.alias.default])
def _detach(func: Any, args: tuple, kwargs: dict) -> Float8Tensor:
    t = args[0]
    return t._rewrap(func(t._data))


@implements([
    aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.as_strided.default,
])
def _view(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    t = args[0]
    data = func(t._data, *args[1:], **kwargs)
    if t._block is None:
        return t._rewrap(data)
    grid_shape = t.tile_shape
    if func in _SAME_GRID and data.shape == grid_shape:
        return t._rewrap(data, tile_shape=None)  # the grid's own 2-D shape (back from a flat view)
    if func in _SAME_GRID and data.dim() == 1 and t._data.is_contiguous():
        return t._rewrap(data, tile_shape=grid_shape)  # flat: [Note: FP8 tiled slices]
    if func is aten.as_strided.default and data.shape == t.shape and data.stride() == t._data.stride() \
            and data.storage_offset() == t._data.storage_offset():
        return t._rewrap(data)  # the same view (FSDP2's unsharded parameter)
    return _fallback(func, args, kwargs)  # another scale grid: [Note: Float8Tensor]


_SAME_GRID = (aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
              aten.squeeze.default)


@implements([aten.clone.default])
def _clone(func: Any, args: tuple, kwargs: dict) -> Float8Tensor:
    t = args[0]
    return t._rewrap(func(t._data, **kwargs), share=False)


@implements([aten._to_copy.default])
def _to_copy(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``.to(device)`` keeps FP8; ``.to(floating dtype)`` keeps FP8 with a new nominal dtype;
    ``.to(int dtype)`` returns plain converted values."""
    t = args[0]
    dtype = kwargs.pop("dtype", None) or t.dtype
    if not dtype.is_floating_point:
        return func(t.dequantize(), dtype=dtype, **kwargs)
    data = func(t._data, **kwargs)
    scale_inv = func(t._scale_inv, **{k: v for k, v in kwargs.items() if k == "device"})
    return Float8Tensor(data, scale_inv, t._fp8_format, dtype, block=t._block)


@implements([aten.copy_.default])
def _copy(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    dst, src = args[0], args[1]
    if not isinstance(dst, Float8Tensor):
        return dst.copy_(src.dequantize(dst.dtype))
    if is_slice(dst) and not (isinstance(src, Float8Tensor) and src._fp8_format is dst._fp8_format
                              and torch.equal(src._scale_inv, dst._scale_inv)):
        _refuse_slice_write(dst, "copy_ of values with another scale")
    if isinstance(src, Float8Tensor) and src._fp8_format is dst._fp8_format and src._block == dst._block \
            and src.shape == dst.shape:
        # Bit-exact: the same bytes and the same scale (or scale grid).
        dst._data.copy_(src._data)
        dst._scale_inv.copy_(src._scale_inv)
        dst._meta.bytes_changed()
        return dst
    value = src.dequantize() if isinstance(src, Float8Tensor) else src
    if value.shape != dst.shape:
        value = value.expand(dst.shape)
    _keep_hp_init_val(dst, value)
    return dst.quantize_(value.to(dst.device))


def _keep_hp_init_val(f8: Float8Tensor, hp: torch.Tensor) -> None:
    """A weight re-initialized in place (``nn.init.normal_(w)``, ``w.copy_(x)``) while its
    high-precision init value is preserved keeps the new high-precision value, so the
    optimizer's master starts from what init really drew, not from the first draw."""
    if f8.get_high_precision_init_val() is not None:
        f8.set_high_precision_init_val(hp)


@implements([aten.is_same_size.default])
def _is_same_size(func: Any, args: tuple, kwargs: dict) -> bool:
    return bool(args[0].shape == args[1].shape)


@implements([aten.empty_like.default])
def _empty_like(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``empty_like`` keeps FP8 (new bytes, scale 1), so ``Module.to_empty`` materializes a
    model built on the meta device with FP8 weights; ``reset_parameters`` then fills them."""
    t = args[0]
    dtype = kwargs.pop("dtype", None) or t.dtype
    if not dtype.is_floating_point:
        return func(t.dequantize(), dtype=dtype, **kwargs)
    data = func(t._data, **kwargs)
    scale_inv = torch.ones(t._scale_inv.shape, dtype=torch.float32, device=data.device)
    return Float8Tensor(data, scale_inv, t._fp8_format, dtype, block=t._block)


# ---------------------------------------------------------------------------- FSDP2 sharding
# fully_shard cuts a weight with torch.chunk (split), pads the shard (new_zeros + narrow, i.e.
# slice, + copy_) and views it flat: with these the shard stays FP8 ([Note: FSDP2 extension]).
# [Note: FP8 slices]
#     A slice (``t[a:b]``, ``narrow``, ``chunk``/``split``) is a view of the bytes that shares the
#     whole tensor's scale. Writing into it may not change that scale: an in-place op, or a copy
#     of high-precision values, would re-quantize the slice from its own amax and re-scale every
#     other element with it (and on an FSDP2 shard give each rank its own scale), so both raise;
#     a copy of FP8 bytes with the same scale is exact and allowed (FSDP2 pads shards this way).
#     Slices of a rowwise or blockwise tensor hold their own grid rows: [Note: FP8 tiled slices].
_SLICE = "_fp8_slice"


def _mark_slice(t: Float8Tensor) -> Float8Tensor:
    t.__dict__[_SLICE] = True
    return t


def is_slice(t: Float8Tensor) -> bool:
    return bool(t.__dict__.get(_SLICE, False))


def _refuse_slice_write(t: Float8Tensor, what: str) -> None:
    raise RuntimeError(
        f"{what} on a slice of a Float8Tensor would re-quantize the slice and change the scale "
        "of the whole tensor ([Note: FP8 slices]); write the whole tensor (t.copy_(x) or "
        "t.quantize_(x)), or work on t.dequantize()")


@implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    t = args[0]
    pieces = func(t._data, *args[1:], **kwargs)
    if t._block is None:
        return [_mark_slice(t._rewrap(d)) for d in pieces]
    rows = [_tiled_rows(t, d) for d in pieces]  # [Note: FP8 tiled slices]
    if any(r is None for r in rows):
        return _fallback(func, args, kwargs)  # a cut through a tile: [Note: Float8Tensor]
    return rows  # type: ignore[return-value]


@implements([aten.slice.Tensor])
def _slice(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    t = args[0]
    data = func(t._data, *args[1:], **kwargs)
    if t._block is None:
        return _mark_slice(t._rewrap(data))
    rows = _tiled_rows(t, data)
    return _fallback(func, args, kwargs) if rows is None else rows


# [Note: FP8 tiled slices]
#     A rowwise or blockwise tensor keeps FP8 through a cut along dim 0 that falls on its tiles'
#     row boundaries (any row for rowwise; multiples of 128 for blockwise, or the last row): the
#     slice views its rows of the bytes and its rows of the scale grid, which no other part of
#     the tensor shares, so unlike a per-tensor slice ([Note: FP8 slices]) it may be written
#     (copy_, in-place ops re-quantize its own tiles). Every other cut puts bytes under another
#     tile's scale and falls back to the dequantized values. ``new_zeros``/``new_empty`` with the
#     tensor's columns keep FP8 (zero or new bytes, a grid of ones), and a contiguous tiled
#     tensor viewed flat keeps FP8 and remembers the 2-D shape its grid tiles (``tile_shape``).
#     These are the ops FSDP2's ``fully_shard`` uses: chunk (split), new_zeros, narrow (slice),
#     copy_, view(-1) ([Note: FSDP2 extension]).
def _tiled_rows(t: Float8Tensor, data: torch.Tensor) -> Float8Tensor | None:
    """``data`` (a view of ``t``'s bytes) as a Float8Tensor with its rows of the scale grid, if
    it is whole rows ``[start, stop)`` of the 2-D ``t`` cut on tile boundaries; else None."""
    whole = t._data
    if whole.dim() != 2 or data.dim() != 2 or data.shape[1:] != whole.shape[1:] \
            or data.stride() != whole.stride():
        return None
    offset = data.storage_offset() - whole.storage_offset()
    row = max(whole.stride(0), 1)
    if offset % row:
        return None
    br, rows = t._block[0], whole.shape[0]  # type: ignore[index]
    start = offset // row
    stop = start + data.shape[0]
    if start % br or (stop % br and stop != rows):
        return None
    grid = t._scale_inv[start // br:-(-stop // br)]
    return Float8Tensor(data, grid, t._fp8_format, t.dtype, meta=t._meta, block=t._block)


@implements([aten.new_zeros.default, aten.new_empty.default])
def _new_zeros(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """New FP8 bytes (zeros, or uninitialized) with a copy of the scale, so a shard padded or
    created empty by FSDP2 carries the same scale as its neighbours. A tiled tensor: the same
    columns keep FP8, with a grid of ones ([Note: FP8 tiled slices])."""
    t = args[0]
    dtype = kwargs.pop("dtype", None) or t.dtype
    size = tuple(args[1]) if len(args) > 1 else ()
    tiled_ok = t._block is not None and len(size) == 2 and size[1] == t.tile_shape[1]
    if not dtype.is_floating_point or (t._block is not None and not tiled_ok):
        return func(t.dequantize(), *args[1:], dtype=dtype, **kwargs)
    kwargs.pop("layout", None)
    data = func(t._data, *args[1:], **kwargs)
    if t._block is None:
        return Float8Tensor(data, t._scale_inv.clone(), t._fp8_format, dtype)
    br = t._block[0]
    grid = torch.ones((-(-size[0] // br), t._scale_inv.shape[1]), dtype=torch.float32, device=data.device)
    return Float8Tensor(data, grid, t._fp8_format, dtype, block=t._block)

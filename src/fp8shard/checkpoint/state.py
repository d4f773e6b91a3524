"""Model-space checkpoint state: which tensors a checkpoint holds, under which keys.

[Note: checkpoint keys]
    Everything is per model entry (parameter or buffer, by its ``state_dict`` name), never per
    bucket, so a checkpoint written at world size N loads at world size M
    ([Note: checkpoint space]):

      model/<name>                       a high-precision parameter or buffer, as stored
      model/<name>:fp8_bytes             an FP8 weight's bytes as uint8, in the weight's shape
      model/<name>:scale_inv             its fp32 scale_inv (value = bytes x scale_inv): 0-d, or
                                         the scale grid of a rowwise or blockwise weight, whose
                                         manifest entry names its tile as ``fp8_block``
      optim/<name>/master|exp_avg|exp_avg_sq
                                         DistributedFusedAdam: 1-D over the flattened parameter,
                                         saved as the pieces each rank owns ([Note: flat pieces])
      optim/<name>/fp8_scale, fp8_amax_history
                                         the optimizer's weight-scaling state of an FP8 weight
      optim/<name>/<key>                 a torch.optim optimizer's per-parameter tensor states
      rng/<rank>/<generator>             each rank's RNG states

    Model entries are the same on every rank, so DCP writes each once. The JSON manifest
    (io.py) records, per entry, its kind, shape, nominal dtype and FP8 format, and the
    optimizer's scalars (step, param groups); loading checks a model against it before reading
    a byte of tensor data.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fp8shard.checkpoint.errors import CheckpointMismatchError
from fp8shard.fp8 import Float8Tensor, Fp8Format
from fp8shard.fp8.tiled import quantize_tiles
from fp8shard.optim.fsdp2 import local_shard, shard_rows

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"
FP8_BYTES, SCALE_INV = ":fp8_bytes", ":scale_inv"
# Buffers fp8shard.nn.Linear creates at its first delayed-scaling forward (or when loading them),
# so a freshly built model may lack them, or have them while a checkpoint does not.
LAZY_BUFFERS = ("fp8_amax_history", "fp8_scale")


def unwrap(model: nn.Module) -> nn.Module:
    """The module itself for a DDP-wrapped model, so its names carry no ``module.`` prefix."""
    inner = getattr(model, "module", None)
    if isinstance(model, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        return inner
    return model


# The dtypes a checkpoint may name (in its manifest, or pickled in DCP's metadata as ``torch.<name>``),
# by canonical name. A table, not ``getattr(torch, name)``: a name from a file is only ever looked
# up here. Names this torch lacks are left out.
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "bool",
)
DTYPES: dict[str, torch.dtype] = {
    n: dt for n in _DTYPE_NAMES if isinstance(dt := getattr(torch, n, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dt = DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise CheckpointMismatchError(f"the checkpoint names an unknown dtype {name!r}")
    return dt


def is_lazy(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LAZY_BUFFERS


def name_list(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")


# ---------------------------------------------------------------------------- model
def model_save_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(tensors by key, manifest entries by name) of a model's ``state_dict``."""
    model = unwrap(model)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, t in model.state_dict().items():
        entry: dict[str, Any] = {"kind": "param" if name in params else "buffer",
                                 "shape": list(t.shape), "dtype": dtype_name(t.dtype), "fp8": None}
        if is_sharded(t) and isinstance(local_shard(t), Float8Tensor):
            # FSDP2: this rank's rows of the bytes, as a DTensor DCP writes as chunks of the
            # same global uint8 tensor the flat engine writes whole ([Note: FSDP2 engine]).
            local = local_shard(t)
            entry["fp8"] = local.fp8_format.value
            tensors[MODEL + name + FP8_BYTES] = _rows_dtensor(t, local.uint8_view(), t.shape)
            if local.block is None:
                tensors[MODEL + name + SCALE_INV] = local.scale_inv.reshape(())
            else:  # this rank's rows of the grid ([Note: FSDP2 tiled weights])
                grid = scale_shape(entry["shape"], local.block)
                tensors[MODEL + name + SCALE_INV] = _rows_dtensor(t, local.scale_inv, torch.Size(grid))
                entry["fp8_block"] = list(local.block)
        elif isinstance(t, Float8Tensor):
            entry["fp8"] = t.fp8_format.value
            tensors[MODEL + name + FP8_BYTES] = t.uint8_view()
            tensors[MODEL + name + SCALE_INV] = t.scale_inv.reshape(scale_shape(entry["shape"], t.block))
            if t.block is not None:
                entry["fp8_block"] = list(t.block)
        else:
            tensors[MODEL + name] = t
        entries[name] = entry
    return tensors, entries


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (a parameter of a ``fully_shard``-ed model)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _rows_dtensor(t: torch.Tensor, local: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``local`` (this rank's rows of a ``shape`` tensor, cut as ``t`` is) as a DTensor DCP writes
    as chunks of one global tensor."""
    from torch.distributed.tensor import DTensor

    stride = torch._prims_common.make_contiguous_strides_for(shape)
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=shape, stride=stride)


def _copy_into_shard(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's rows of the full ``value`` into a sharded parameter's local shard."""
    start, rows = shard_rows(param)
    local = local_shard(param)
    if isinstance(local, Float8Tensor) and isinstance(value, Float8Tensor) and local.block == value.block:
        # Bytes and scale (or this rank's rows of the scale grid), bit-exact (an empty shard still
        # carries the scale).
        local.fp8_data.copy_(value.fp8_data[start:start + rows])
        if local.block is None:
            local.scale_inv.copy_(value.scale_inv)
        else:  # FSDP2 cut the weight on tile rows ([Note: FSDP2 tiled weights])
            br = local.block[0]
            local.scale_inv.copy_(value.scale_inv[start // br:-(-(start + rows) // br)])
        local.mark_bytes_changed()
    elif isinstance(local, Float8Tensor):
        # A high-precision checkpoint (or FP8 of another scaling) into FP8 shards: quantized whole,
        # one scale per weight from its global amax (current scaling per shard would give every
        # rank its own scale), or per row / block as the shard's grid is.
        hp = value.dequantize() if isinstance(value, Float8Tensor) else value
        if local.block is None:
            whole = Float8Tensor.quantize(hp, local.fp8_format)
        else:
            data, scale_inv = quantize_tiles(hp.float(), local.fp8_format, local.block)
            whole = Float8Tensor(data, scale_inv, local.fp8_format, hp.dtype, block=local.block)
        _copy_into_shard(param, whole)
    elif rows:
        local.copy_(value[start:start + rows])


def scale_shape(shape: list[int], block: Any) -> list[int]:
    """The shape of an FP8 weight's ``scale_inv``: [] for one scale, else its tile grid."""
    if block is None:
        return []
    return [-(-shape[0] // block[0]), -(-shape[1] // block[1])]


def model_keys(name: str, entry: dict[str, Any]) -> dict[str, tuple[list[int], torch.dtype]]:
    """DCP keys of one manifest entry with the shape and dtype each must have."""
    if entry["fp8"]:
        scales = scale_shape(entry["shape"], entry.get("fp8_block"))
        return {MODEL + name + FP8_BYTES: (entry["shape"], torch.uint8),
                MODEL + name + SCALE_INV: (scales, torch.float32)}
    return {MODEL + name: (entry["shape"], parse_dtype(entry["dtype"]))}


def check_model(model: nn.Module, entries: dict[str, dict[str, Any]], strict: bool) -> list[str]:
    """Names to load; raises ``CheckpointMismatchError`` naming each problem. Touches nothing."""
    model = unwrap(model)
    mine = model.state_dict()
    missing = [n for n in mine if n not in entries and not is_lazy(n)]
    unexpected = [n for n in entries if n not in mine and not _accepts_lazy(model, n)]
    problems = []
    if strict and missing:
        problems.append(f"the checkpoint lacks {len(missing)} entries of the model: {name_list(missing)}")
    if strict and unexpected:
        problems.append(f"the checkpoint has {len(unexpected)} entries the model lacks: "
                        f"{name_list(unexpected)}")
    for n, e in entries.items():
        if n in mine and list(mine[n].shape) != list(e["shape"]):
            problems.append(f"{n!r}: the checkpoint has shape {tuple(e['shape'])}, the model has "
                            f"{tuple(mine[n].shape)}")
    if problems:
        raise CheckpointMismatchError("checkpoint does not fit the model (nothing was loaded):\n  "
                                      + "\n  ".join(problems))
    return [n for n in entries if n in mine or _accepts_lazy(model, n)]


def _accepts_lazy(model: nn.Module, name: str) -> bool:
    from fp8shard.nn import Linear

    if not is_lazy(name):
        return False
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    try:
        return isinstance(model.get_submodule(owner), Linear)
    except AttributeError:
        return False


def model_targets(names: list[str], entries: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Fresh CPU tensors DCP reads the model entries into (the model is untouched until apply)."""
    out = {}
    for n in names:
        for key, (shape, dtype) in model_keys(n, entries[n]).items():
            out[key] = torch.empty(shape, dtype=dtype)
    return out


def read_entry(name: str, entry: dict[str, Any], loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loaded value of one entry: a Float8Tensor for an FP8 entry, else a plain tensor."""
    if entry["fp8"]:
        fmt = Fp8Format.parse(entry["fp8"])
        data = loaded[MODEL + name + FP8_BYTES].view(fmt.torch_dtype)
        block = entry.get("fp8_block")
        scale_inv = loaded[MODEL + name + SCALE_INV].reshape(scale_shape(entry["shape"], block)).float()
        return Float8Tensor(data, scale_inv, fmt, parse_dtype(entry["dtype"]),
                            block=None if block is None else tuple(block))
    return loaded[MODEL + name]


def apply_model(model: nn.Module, names: list[str], entries: dict[str, dict[str, Any]],
                loaded: dict[str, torch.Tensor], strict: bool) -> None:
    """Copy loaded entries into the model in place (parameters stay the optimizer's views).

    FP8 into FP8: bytes and scale, bit-exact. FP8 into a high-precision parameter: dequantized.
    High precision into FP8: quantized with current scaling (``Float8Tensor.copy_``).
    """
    model = unwrap(model)
    mine = model.state_dict()
    sd: dict[str, torch.Tensor] = {}
    sharded: set[str] = set()
    for n in names:
        value = read_entry(n, entries[n], loaded)
        cur = mine.get(n)
        if cur is not None and is_sharded(cur):
            local = local_shard(cur)
            if isinstance(value, Float8Tensor) and not isinstance(local, Float8Tensor):
                value = value.dequantize(local.dtype)
            with torch.no_grad():
                _copy_into_shard(cur, value)  # FSDP2: the full value was read, keep my rows
            sharded.add(n)
            continue
        if isinstance(value, Float8Tensor) and cur is not None and not isinstance(cur, Float8Tensor):
            value = value.dequantize(cur.dtype)
        sd[n] = value
    result = model.load_state_dict(sd, strict=False)
    left = [k for k in result.missing_keys if not is_lazy(k) and k not in sharded] if strict else []
    if left or (strict and result.unexpected_keys):
        raise CheckpointMismatchError(f"load_state_dict left missing={left}, unexpected="
                                      f"{result.unexpected_keys}")

"""Weights in and out: weights-only loading, importing high-precision state dicts, safetensors export.

None of these is collective: each process reads what it needs on its own (DCP ``no_dist``), so
an evaluation script or a single rank can use them. All of them go through the same checks as
:func:`load_checkpoint` (manifest version, file sizes and hashes, names and shapes) before the
model is touched.

Why the FP32 master matters here: an FP8 weight is a rounded copy of the optimizer's FP32
master. For fine-tuning, the new optimizer's master should start from the saved master, not
from the FP8 bytes (the early-convergence problem of TransformerEngine 1121), so
:func:`load_model_weights` hands the master to each FP8 weight as its preserved
high-precision init value, which ``DistributedFusedAdam`` starts from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import fp8shard
from fp8shard.checkpoint import state as ms
from fp8shard.checkpoint.errors import CheckpointError, CheckpointMismatchError
from fp8shard.checkpoint.io import LoadedCheckpoint, _check_keys, resolve_checkpoint, single_process_quiet
from fp8shard.checkpoint.manifest import check_storage_listed, read_manifest, verify_files
from fp8shard.checkpoint.planner import PiecesLoadPlanner, SafeFileSystemReader, read_dcp_metadata
from fp8shard.fp8 import Float8Tensor

Source = Literal["weights", "master"]


def _read(path: str | os.PathLike, names: list[str] | None, masters: list[str], verify: bool
          ) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """Read model entries ``names`` (None: all) and the FP32 masters of ``masters`` into fresh
    CPU tensors, without a process group."""
    ck = resolve_checkpoint(path)
    manifest = read_manifest(ck)
    if verify:
        verify_files(ck, manifest)
    md = read_dcp_metadata(ck)
    check_storage_listed(ck, md, manifest)
    entries = manifest["model"]
    names = list(entries) if names is None else names
    targets = ms.model_targets(names, entries)
    want = {k: shape for n in names for k, (shape, _) in ms.model_keys(n, entries[n]).items()}
    for n in masters:
        key = f"{ms.OPTIM}{n}/master"
        targets[key] = torch.empty(int(torch.Size(entries[n]["shape"]).numel()), dtype=torch.float32)
        want[key] = list(targets[key].shape)
    _check_keys(md, want)
    with single_process_quiet():
        dcp.load(targets, storage_reader=SafeFileSystemReader(ck), planner=PiecesLoadPlanner({}),
                 no_dist=True)
    return ck, manifest, targets


def _saved_masters(manifest: dict[str, Any]) -> set[str]:
    opt = manifest.get("optimizer") or {}
    return set(opt.get("params", {})) if opt.get("kind") == "distributed_fused_adam" else set()


def load_model_weights(path: str | os.PathLike, model: nn.Module, *, strict: bool = True,
                       hp_from_master: bool = True, verify: bool = True) -> LoadedCheckpoint:
    """Load only the model's weights (and buffers) from a checkpoint, e.g. for evaluation.

    FP8 and high-precision weights convert either way (see ``state.apply_model``). With
    ``hp_from_master``, each FP8 weight also gets the checkpoint's FP32 master as its
    high-precision init value, so an optimizer built afterwards starts from it; build the
    optimizer after this call.
    """
    ck = resolve_checkpoint(path)
    manifest = read_manifest(ck)
    names = ms.check_model(model, manifest["model"], strict)
    inner = ms.unwrap(model)
    fp8_params = {n for n, p in inner.named_parameters() if isinstance(p, Float8Tensor)}
    masters = sorted(fp8_params & _saved_masters(manifest) & set(names)) if hp_from_master else []
    ck, manifest, targets = _read(ck, names, masters, verify)
    ms.apply_model(model, names, manifest["model"], targets, strict)
    for n, p in inner.named_parameters():
        if isinstance(p, Float8Tensor):
            if n in masters:
                p.set_high_precision_init_val(targets[f"{ms.OPTIM}{n}/master"].view(p.shape))
            else:
                p.clear_high_precision_init_val()  # a value from before the load would be stale
    return LoadedCheckpoint(ck, manifest.get("step"), int(manifest["world_size"]),
                            manifest.get("extra") or {}, False)


def read_model_state(path: str | os.PathLike, *, source: Source = "weights", dtype: torch.dtype | None = None,
                     include_buffers: bool = False, verify: bool = True) -> dict[str, torch.Tensor]:
    """A checkpoint's model as plain high-precision tensors (CPU), the model not needed.

    ``source="weights"``: what the model computed with (FP8 weights dequantized);
    ``"master"``: the optimizer's FP32 master where the checkpoint has one. ``dtype``: cast
    floating-point tensors to it (default: the FP32 master as it is, fp32, and every other
    entry in its nominal dtype).
    """
    if source not in ("weights", "master"):
        raise ValueError(f"source must be 'weights' or 'master', got {source!r}")
    ck = resolve_checkpoint(path)
    manifest = read_manifest(ck)
    entries = manifest["model"]
    names = [n for n, e in entries.items() if include_buffers or e["kind"] == "param"]
    masters = sorted(_saved_masters(manifest) & set(names)) if source == "master" else []
    _, _, targets = _read(ck, names, masters, verify)
    out = {}
    for n in names:
        nominal = ms.parse_dtype(entries[n]["dtype"])
        if n in masters:
            t = targets[f"{ms.OPTIM}{n}/master"].view(entries[n]["shape"])
        else:
            t = ms.read_entry(n, entries[n], targets)
            t = t.dequantize(nominal) if isinstance(t, Float8Tensor) else t
        own = torch.float32 if n in masters else nominal  # a master is never rounded unasked
        want = dtype if (dtype is not None and t.is_floating_point()) else own
        out[n] = t.to(want).contiguous()
    return out


def export_safetensors(path_or_ckpt: str | os.PathLike | None, model: nn.Module | None,
                       out_file: str | os.PathLike, *, source: Source = "weights",
                       dtype: torch.dtype | Literal["auto"] | None = "auto", include_buffers: bool = False,
                       verify: bool = True, metadata: Mapping[str, str] | None = None) -> Path:
    """Write one consolidated high-precision ``.safetensors`` file for inference elsewhere.

    From a checkpoint (``path_or_ckpt``; ``model`` may be None) or, with ``path_or_ckpt=None``,
    from ``model``'s current weights. ``dtype``: ``"auto"`` (default) writes bf16 from the
    weights and fp32 from the FP32 masters (``source="master"``: never rounded unless a dtype
    says so); None keeps each tensor's own dtype. ``metadata``: extra string entries for the
    file's header (e.g. the model configuration). Written by rank 0 only when a process group
    exists, to a temporary name and renamed. Needs the optional ``safetensors`` package.
    """
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError("export_safetensors needs the `safetensors` package: pip install "
                              "safetensors (or pip install fp8shard[export])") from None
    out = Path(out_file)
    if dtype == "auto":
        dtype = torch.float32 if source == "master" else torch.bfloat16
    if path_or_ckpt is not None:
        tensors = read_model_state(path_or_ckpt, source=source, dtype=dtype,
                                   include_buffers=include_buffers, verify=verify)
        note = {"source": str(source), "checkpoint": str(resolve_checkpoint(path_or_ckpt))}
    elif model is not None:
        tensors = _model_tensors(model, dtype, include_buffers)
        note = {"source": "model"}
    else:
        raise ValueError("export_safetensors needs a checkpoint path or a model")
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    meta = {"format": "pt", "producer": f"fp8shard {fp8shard.__version__}", **note,
            "dtype": "own" if dtype is None else str(dtype).removeprefix("torch."), **(metadata or {})}
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, out)
    return out


def _model_tensors(model: nn.Module, dtype: torch.dtype | None,
                   include_buffers: bool) -> dict[str, torch.Tensor]:
    inner = ms.unwrap(model)
    params = {n for n, _ in inner.named_parameters(remove_duplicate=False)}
    out = {}
    for n, t in inner.state_dict().items():
        if not include_buffers and n not in params:
            continue
        t = t.dequantize() if isinstance(t, Float8Tensor) else t.detach()
        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        out[n] = t.to("cpu").clone().contiguous()  # clone: tied weights must not share storage
    return out


# ---------------------------------------------------------------------------- import
KeyMap = Mapping[str, str] | Callable[[str], "str | None"]
_PREFIXES = ("module.", "_orig_mod.", "model.")


def read_state_dict_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, a Hugging Face model directory (single or sharded
    safetensors, or ``pytorch_model.bin``), or a ``torch.save`` file (``weights_only=True``)."""
    p = Path(path)
    if p.is_dir():
        for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
            if (p / name).exists():
                return read_state_dict_file(p / name)
        raise CheckpointError(f"{p} holds no model.safetensors(.index.json) or pytorch_model.bin")
    if not p.exists():
        raise FileNotFoundError(f"no such state dict file: {p}")
    if p.name.endswith(".index.json"):
        import json

        files = sorted(set(json.loads(p.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(read_state_dict_file(p.parent / f))
        return out
    if p.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError("reading .safetensors needs the `safetensors` package: pip install "
                                  "safetensors") from None
        return load_file(str(p))
    sd = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{p} does not hold a flat dict of tensors (a state dict)")
    return sd


def _rename(sd: Mapping[str, torch.Tensor], key_map: KeyMap | None,
            model_keys: set[str]) -> dict[str, torch.Tensor]:
    if key_map is not None:
        out = {}
        for k, v in sd.items():
            new = key_map.get(k, k) if isinstance(key_map, Mapping) else key_map(k)
            if new is not None:
                out[new] = v
        return out
    # Without a map: strip a wrapper prefix (DDP's module., compile's _orig_mod., HF's model.)
    # when that makes more names match the model.
    best = dict(sd)
    for prefix in _PREFIXES:
        cand = {k.removeprefix(prefix): v for k, v in sd.items()}
        if len(model_keys & cand.keys()) > len(model_keys & best.keys()):
            best = cand
    return best


def import_hf_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | str | os.PathLike, *,
                         key_map: KeyMap | None = None, strict: bool = True) -> list[str]:
    """Load a high-precision state dict (plain or Hugging Face-style; a dict or a file/directory)
    into a model whose weights may be FP8: each FP8 weight is quantized with current scaling
    from its value, which is also kept as its high-precision init value so the optimizer's
    master starts from it exactly. Call before building the optimizer. Returns the loaded names.

    ``key_map`` renames keys (a dict, or a function returning the new name or None to drop).
    Checks every name and shape first; nothing is changed if any does not fit.
    """
    raw = read_state_dict_file(state_dict) if isinstance(state_dict, (str, os.PathLike)) else state_dict
    inner = ms.unwrap(model)
    live: dict[str, torch.Tensor] = dict(inner.named_parameters(remove_duplicate=False))
    live.update(dict(inner.named_buffers(remove_duplicate=False)))
    mine = inner.state_dict()
    sd = _rename(raw, key_map, set(mine))
    missing = [n for n in mine if n not in sd and not ms.is_lazy(n)]
    unexpected = [n for n in sd if n not in mine]
    problems = []
    if strict and missing:
        problems.append(f"the state dict lacks {len(missing)} entries of the model: {ms.name_list(missing)}")
    if strict and unexpected:
        problems.append(f"the state dict has {len(unexpected)} entries the model lacks: "
                        f"{ms.name_list(unexpected)} (rename them with key_map=..., or pass strict=False)")
    for n, v in sd.items():
        if n in mine and tuple(v.shape) != tuple(mine[n].shape):
            problems.append(f"{n!r}: the state dict has shape {tuple(v.shape)}, the model has "
                            f"{tuple(mine[n].shape)}")
        elif n in mine and not (v.is_floating_point() or not mine[n].is_floating_point()):
            problems.append(f"{n!r}: the state dict holds {v.dtype}, the model a floating-point tensor")
    if problems:
        raise CheckpointMismatchError("cannot import the state dict (nothing was loaded):\n  "
                                      + "\n  ".join(problems))
    loaded = []
    with torch.no_grad():
        for n, v in sd.items():
            if n not in mine:
                continue
            t = live.get(n, mine[n])
            if isinstance(t, Float8Tensor):
                hp = v.to(t.device, torch.float32)
                t.quantize_(hp)
                t.set_high_precision_init_val(hp)
            else:
                t.copy_(v)
            loaded.append(n)
    return loaded

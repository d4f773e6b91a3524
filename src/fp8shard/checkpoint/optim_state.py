"""Optimizer state in model space: save, check against a checkpoint, load in place.

See [Note: checkpoint keys] (state.py). ``DistributedFusedAdam`` saves the pieces of its master
and Adam states each rank owns ([Note: flat pieces]) and loads the pieces the loading rank owns,
whatever the saving world size was; a ``torch.optim`` optimizer (the DDP baseline) saves its
full, replicated per-parameter states.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fp8shard.checkpoint.errors import CheckpointFormatError, CheckpointMismatchError
from fp8shard.checkpoint.planner import FlatPieces
from fp8shard.checkpoint.state import OPTIM, dtype_name, parse_dtype, unwrap
from fp8shard.optim.core import ShardedAdam, _check_hparams

DFA_STATES = ("master", "exp_avg", "exp_avg_sq")
DFA_KIND = "distributed_fused_adam"
# Both engines hold the same state (fp32 master + Adam moments per parameter, the same FP8 weight
# scaling) and ShardedAdam saves it in the same model-space pieces from either engine's sharded
# view, so their checkpoints are one kind and either resumes the other ([Note: engine]).
SHARDED_ADAMS = ShardedAdam


@dataclasses.dataclass
class OptimizerLoad:
    """What DCP must fill for an optimizer, and how to copy it in once everything is read."""

    tensors: dict[str, torch.Tensor]
    flat: dict[str, FlatPieces]
    apply: Callable[[], None]


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    if isinstance(optimizer, SHARDED_ADAMS):
        return DFA_KIND
    return f"torch.optim.{type(optimizer).__name__}"


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model name of each optimizer parameter, in the optimizer's (flattened) order."""
    model = unwrap(model)
    by_id: dict[int, str] = {}
    for n, p in model.named_parameters():
        by_id.setdefault(id(p), n)
    names = []
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        if id(p) not in by_id:
            raise CheckpointMismatchError(f"optimizer parameter {i} (shape {tuple(p.shape)}) is not a "
                                          "parameter of the model; pass the model the optimizer trains")
        names.append(by_id[id(p)])
    return names


def _json_value(v: Any, what: str) -> Any:
    if isinstance(v, tuple):
        v = list(v)
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        raise CheckpointMismatchError(f"{what} = {v!r} cannot be saved in the JSON manifest") from None
    return v


def _groups(optimizer: torch.optim.Optimizer, names: list[str]) -> list[dict[str, Any]]:
    out, i = [], 0
    for g in optimizer.param_groups:
        entry = {k: _json_value(v, f"param group option {k!r}") for k, v in g.items() if k != "params"}
        entry["params"] = names[i:i + len(g["params"])]
        i += len(g["params"])
        out.append(entry)
    return out


# ---------------------------------------------------------------------------- save
def optimizer_save_state(optimizer: torch.optim.Optimizer, names: list[str]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, FlatPieces], dict[str, Any]]:
    """(replicated tensors, this rank's pieces, manifest section) of an optimizer."""
    tensors: dict[str, torch.Tensor] = {}
    flat: dict[str, FlatPieces] = {}
    if isinstance(optimizer, SHARDED_ADAMS):
        ssd = optimizer.sharded_state_dict()
        params: dict[str, dict[str, Any]] = {}
        for i, shape in ssd["shapes"].items():
            name, numel = names[i], math.prod(shape)
            pieces = ssd["state"].get(i, [])
            for k in DFA_STATES:
                flat[f"{OPTIM}{name}/{k}"] = FlatPieces(numel, {int(e["offset"]): e[k] for e in pieces})
            params[name] = {"numel": numel, "fp8": i in ssd["fp8"]}
        for i, st in ssd["fp8"].items():
            tensors[f"{OPTIM}{names[i]}/fp8_scale"] = st["scale"]  # 0-d, or a rowwise/blockwise grid
            if "amax_history" in st:
                tensors[f"{OPTIM}{names[i]}/fp8_amax_history"] = st["amax_history"]
                params[names[i]]["amax_history_len"] = int(st["amax_history"].shape[0])
        state_dtype = dtype_name(optimizer.state_dtype)
        section = {"kind": DFA_KIND, "step": int(ssd["step"]), "state_dtype": state_dtype,
                   "param_groups": _groups(optimizer, names), "params": params}
        return tensors, flat, section
    # A torch.optim optimizer (e.g. AdamW under DDP): full per-parameter states on every rank.
    sd = optimizer.state_dict()
    state: dict[str, dict[str, Any]] = {}
    for i, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{OPTIM}{names[i]}/{k}"] = v
                state.setdefault(names[i], {})[k] = {"tensor": list(v.shape), "dtype": dtype_name(v.dtype)}
            else:
                state.setdefault(names[i], {})[k] = {"value": _json_value(v, f"optimizer state {k!r}")}
    section = {"kind": kind_of(optimizer), "param_groups": _groups(optimizer, names), "state": state}
    return tensors, flat, section


# ---------------------------------------------------------------------------- load
def optimizer_load(optimizer: torch.optim.Optimizer, names: list[str], section: dict[str, Any] | None
                   ) -> OptimizerLoad:
    """Check ``section`` (the manifest's) against the optimizer and prepare fresh targets.

    Raises ``CheckpointMismatchError`` before anything is read or changed.
    """
    if section is None:
        raise CheckpointMismatchError("the checkpoint holds no optimizer state; load the weights with "
                                      "load_model_weights() and start a fresh optimizer")
    if section["kind"] != kind_of(optimizer):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer is {section['kind']}, this one is {kind_of(optimizer)}; load "
            "the weights with load_model_weights() and start a fresh optimizer")
    saved = [g["params"] for g in section["param_groups"]]
    mine = [list(names[i:i + len(g["params"])]) for i, g in zip(_starts(optimizer), optimizer.param_groups,
                                                                   strict=True)]
    if saved != mine:
        raise CheckpointMismatchError(
            f"the optimizer's param groups differ from the checkpoint's: {_first_difference(saved, mine)}")
    _check_group_options(optimizer, section["param_groups"])
    if isinstance(optimizer, SHARDED_ADAMS):
        return _dfa_load(optimizer, names, section)
    return _torch_load(optimizer, names, section)


def _same_kind(mine: Any, saved: Any) -> bool:
    """Whether a saved param group option can stand in for this optimizer's value of it."""
    if isinstance(mine, bool):
        return isinstance(saved, bool)
    if isinstance(mine, (int, float)):
        return type(saved) in (int, float) and math.isfinite(saved)
    if isinstance(mine, (tuple, list)):
        return (isinstance(saved, list) and len(saved) == len(mine)
                and all(_same_kind(a, b) for a, b in zip(mine, saved, strict=True)))
    if isinstance(mine, str):
        return isinstance(saved, str)
    return True  # None, or a value JSON cannot hold: nothing to compare with


def _check_group_options(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """The saved options (lr, betas, ...) are of the kinds this optimizer holds, and valid for
    ``DistributedFusedAdam``, before anything is read: they are applied last, after the tensors."""
    for gi, (g, s) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        for k, v in s.items():
            if k != "params" and k in g and not _same_kind(g[k], v):
                raise CheckpointFormatError(
                    f"the checkpoint's optimizer.param_groups[{gi}].{k} is {str(v)[:60]}, which cannot "
                    f"replace this optimizer's {g[k]!r}")
        if isinstance(optimizer, SHARDED_ADAMS):
            merged = {**g, **{k: tuple(v) if k == "betas" else v for k, v in s.items() if k != "params"}}
            try:
                _check_hparams(merged)
            except (ValueError, TypeError) as e:
                raise CheckpointFormatError(f"the checkpoint's optimizer.param_groups[{gi}] is invalid: "
                                            f"{e}") from None


def _starts(optimizer: torch.optim.Optimizer) -> list[int]:
    out, i = [], 0
    for g in optimizer.param_groups:
        out.append(i)
        i += len(g["params"])
    return out


def _first_difference(saved: list[list[str]], mine: list[list[str]]) -> str:
    if len(saved) != len(mine):
        return f"{len(saved)} groups in the checkpoint, {len(mine)} here"
    for gi, (a, b) in enumerate(zip(saved, mine, strict=True)):
        if a != b:
            return f"group {gi} holds {a[:4]}... in the checkpoint, {b[:4]}... here"
    return "?"


def _dfa_load(opt: ShardedAdam, names: list[str],
              section: dict[str, Any]) -> OptimizerLoad:
    opt.wait_param_sync()
    ssd = opt.sharded_state_dict()  # views into the live buffers
    saved = section["params"]
    history_len = opt.fp8_amax_history_len
    tensors: dict[str, torch.Tensor] = {}
    flat: dict[str, FlatPieces] = {}
    fp8_keys: dict[int, dict[str, str]] = {}
    for i, shape in ssd["shapes"].items():
        name, numel = names[i], math.prod(shape)
        if saved[name]["numel"] != numel:
            raise CheckpointMismatchError(f"{name!r}: the checkpoint's optimizer state has "
                                          f"{saved[name]['numel']} elements, the parameter {numel} "
                                          f"(shape {tuple(shape)})")
        for k in DFA_STATES:
            pieces = {int(e["offset"]): torch.empty(int(e["numel"]), dtype=e[k].dtype)
                      for e in ssd["state"].get(i, [])}
            flat[f"{OPTIM}{name}/{k}"] = FlatPieces(numel, pieces)
    for i in ssd["fp8"]:
        name = names[i]
        if not saved[name]["fp8"]:
            continue  # a high-precision checkpoint into an FP8 weight: keep the scale from its bytes
        keys = {"scale": f"{OPTIM}{name}/fp8_scale"}
        tensors[keys["scale"]] = torch.empty(ssd["fp8"][i]["scale"].shape)
        if history_len is not None:
            want, have = history_len, saved[name].get("amax_history_len")
            if have != want:
                raise CheckpointMismatchError(
                    f"{name!r}: this optimizer uses delayed weight scaling with an amax history of "
                    f"{want}, the checkpoint has " + (f"{have}" if have else "no history (current scaling)"))
            keys["amax_history"] = f"{OPTIM}{name}/fp8_amax_history"
            tensors[keys["amax_history"]] = torch.empty(want)
        fp8_keys[i] = keys

    def apply() -> None:
        state = {i: [{"offset": off, "numel": t.numel(), **{k: flat[f"{OPTIM}{names[i]}/{k}"].pieces[off]
                                                           for k in DFA_STATES}}
                     for off, t in flat[f"{OPTIM}{names[i]}/master"].pieces.items()]
                 for i in ssd["shapes"]}
        sharded = {"format": ssd["format"], "step": section["step"], "state": state,
                   "param_groups": section["param_groups"],
                   "fp8": {i: {k: tensors[key] for k, key in keys.items()} for i, keys in fp8_keys.items()}}
        opt.load_sharded_state_dict(sharded)  # pieces of any split; plus step, groups, fp8

    return OptimizerLoad(tensors, flat, apply)


def _torch_load(opt: torch.optim.Optimizer, names: list[str], section: dict[str, Any]) -> OptimizerLoad:
    tensors: dict[str, torch.Tensor] = {}
    index = {n: i for i, n in enumerate(names)}
    for name, st in section["state"].items():
        if name not in index:
            raise CheckpointMismatchError(f"the checkpoint has optimizer state for {name!r}, which this "
                                          "optimizer does not train")
        for k, v in st.items():
            if "tensor" in v:
                tensors[f"{OPTIM}{name}/{k}"] = torch.empty(v["tensor"], dtype=parse_dtype(v["dtype"]))

    def apply() -> None:
        state = {index[name]: {k: tensors[f"{OPTIM}{name}/{k}"] if "tensor" in v else v["value"]
                               for k, v in st.items()} for name, st in section["state"].items()}
        groups = []
        for g, s in zip(opt.param_groups, section["param_groups"], strict=True):
            restored = {k: (tuple(v) if isinstance(g.get(k), tuple) else v) for k, v in s.items()}
            restored["params"] = [index[n] for n in s["params"]]
            groups.append(restored)
        opt.load_state_dict({"state": state, "param_groups": groups})

    return OptimizerLoad(tensors, {}, apply)

"""Choosing and checking the checkpoint a run resumes from.

``resume_candidates`` turns ``trainer.resume`` (and what the run directory already holds) into
the checkpoints to try, refusing to start over on top of an earlier run's;
``load_resume_checkpoint`` loads the first of them that loads (a damaged newest one falls back
to the previous), after ``check_same_data`` has refused one trained on other data
(``DATA_KEYS``, ``data_mismatch``), and checks the fields of its ``extra`` that resuming reads
(``check_extra``). What the loaded state means for the run is ``Trainer._resume``'s (loop.py).
``newest_checkpoint_state`` says, after a failed save, whether the checkpoint a restart would
resume from is intact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp8shard.checkpoint import (
    CheckpointError,
    CheckpointFormatError,
    LoadedCheckpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    resolve_checkpoint,
)
from fp8shard.checkpoint.manifest import MANIFEST, MAX_STEP, verify_files
from fp8shard.train.config import Config, ConfigError, to_dict


def incomplete_checkpoints(root: Path, complete: list[Path]) -> list[Path]:
    """Checkpoint step directories under ``root`` that are not complete (no valid manifest)."""
    if not root.is_dir():
        return []
    done = {p.name for p in complete}
    return sorted(p for p in root.iterdir()
                  if p.name.startswith("step_") and p.is_dir() and p.name not in done)


def _names(paths: list[Path], most: int = 3) -> str:
    shown = ", ".join(p.name for p in paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def resume_candidates(cfg: Config, root: Path) -> list[Path]:
    """Checkpoints to resume from, in order of preference, per ``trainer.resume``.

    A run directory holding an earlier run's checkpoints -- complete ones, or only step
    directories whose manifest is missing -- is never started over silently: ``auto``
    continues the newest complete one and refuses when there is none; ``never`` (or a
    checkpoint elsewhere) refuses unless ``trainer.overwrite=true``, whose deletion happens
    in ``Trainer.__init__`` once every start-up check has passed.
    """
    mode = cfg.trainer.resume
    if isinstance(mode, bool):
        mode = "auto" if mode else "never"
    found = list_checkpoints(root)
    partial = incomplete_checkpoints(root, found)
    if mode == "auto":
        if not found and partial:
            raise ConfigError(
                f"trainer.resume=auto: {root} holds {len(partial)} checkpoint director"
                f"{'y' if len(partial) == 1 else 'ies'} ({_names(partial)}) but none is complete (no "
                "valid manifest.json), so there is nothing to resume, and starting fresh would overwrite "
                "them and the run's metrics: move them away, use another exp_manager.name, or start over "
                "with trainer.resume=never trainer.overwrite=true (deletes them)")
        return found  # newest first; a damaged one falls back to the next
    try:
        chosen = [] if mode == "never" else [resolve_checkpoint(mode)]
    except CheckpointError as e:
        raise ConfigError(f"trainer.resume: {e}") from None
    inside = bool(chosen) and chosen[0].parent.resolve() == root.resolve()
    if cfg.trainer.overwrite:
        if inside:
            raise ConfigError(f"trainer.overwrite=true would delete {chosen[0]}, the checkpoint "
                              "trainer.resume names: copy it elsewhere first, or drop trainer.overwrite")
        return chosen
    if found and not inside:
        # Saving a new lineage beside them would mix the two (auto-resume, keep_last pruning).
        raise ConfigError(f"trainer.resume={mode} but {root} holds checkpoints of an earlier run "
                          f"(newest: {found[0].name}); continue them with trainer.resume=auto, "
                          "start over with trainer.resume=never trainer.overwrite=true (deletes them), or "
                          "use another exp_manager.name")
    if partial and not inside:
        raise ConfigError(f"trainer.resume={mode} but {root} holds incomplete checkpoint directories of an "
                          f"earlier run ({_names(partial)}; no valid manifest.json) that this run would "
                          "overwrite: move them away, use another exp_manager.name, or set "
                          "trainer.overwrite=true (deletes them)")
    return chosen


_COUNTERS = ("step", "skipped_steps", "checkpoint_save_errors", "fp8_overflows", "fp8_nonfinite_amaxes",
             "fp8_saturated")


def check_extra(extra: dict[str, Any], world_size: int, ck: Path) -> None:
    """The fields of a checkpoint's ``extra`` that resuming reads (``Trainer.save`` writes them)
    have their types and ranges; a checkpoint saved by other code may lack any of them."""

    def bad(field: str, what: str) -> ConfigError:
        got = repr(extra[field])
        got = got if len(got) <= 60 else got[:57] + "..."
        return ConfigError(f"trainer.resume: {ck / MANIFEST}: field extra.{field} {what}, got {got}")

    for k in _COUNTERS:
        if k in extra and not (type(extra[k]) is int and 0 <= extra[k] <= MAX_STEP):
            raise bad(k, f"must be an integer from 0 to {MAX_STEP}")
    d = extra.get("data", {})
    if "data" in extra and not (isinstance(d, dict) and all(type(d.get(k)) is int for k in
                                                            ("seed", "seq_len", "consumed_samples"))
                                and d["consumed_samples"] >= 0):
        raise bad("data", "must be an object with integers seed, seq_len and consumed_samples (>= 0)")
    w = extra.get("log_window", {})
    if "log_window" in extra and not (
            isinstance(w, dict) and isinstance(w.get("loss_sums"), list) and len(w["loss_sums"]) == world_size
            and all(type(x) in (int, float) for x in w["loss_sums"])
            and type(w.get("steps")) is int and w["steps"] >= 0):
        raise bad("log_window", f"must be an object with loss_sums ({world_size} numbers, one per saving "
                  "rank) and steps (an integer >= 0)")


DATA_KEYS = ("data.source", "data.token_dtype", "data.markov_order", "data.markov_classes",
             "data.markov_spread", "data.markov_concentration", "data.num_train_tokens",
             "data.num_val_tokens", "data.val_fraction", "data.seed", "model.encoder_seq_length")
"""Keys that change which tokens a step reads: resuming with another value is refused (the
checkpoint's data position would point into other data). data.path and data.tokenizer may
change (a moved file); the number of tokens they give is compared instead. data.vocab_size is
checked by the model's shapes."""


def data_mismatch(saved: dict[str, Any], cfg: Config, tokens: dict[str, int] | None,
                  saved_tokens: dict[str, int] | None) -> str | None:
    """Why a checkpoint saved with config ``saved`` cannot continue on ``cfg``'s data, or None."""
    now = to_dict(cfg)
    markov = cfg.data.source == "markov"
    for key in DATA_KEYS:
        if key.startswith("data.markov_") or key.startswith("data.num_"):
            if not markov:
                continue
        elif key == "data.val_fraction" and markov:
            continue
        section, name = key.split(".")
        if section not in saved or name not in saved[section]:
            continue
        old, new = saved[section][name], now[section][name]
        if old != new:
            return (f"{key}={new!r} but the checkpoint was trained with {key}={old!r}: its data position "
                    f"would point into other data; resume with {key}={old!r}, or start a new run "
                    "(another exp_manager.name)")
    if tokens and saved_tokens and tokens != saved_tokens:
        return (f"data.path: {cfg.data.path} gives {tokens['train']} training and {tokens['val']} validation "
                f"tokens, the checkpoint was trained on {saved_tokens['train']} and {saved_tokens['val']}: "
                "other data; resume with the same file, or start a new run")
    return None


def check_same_data(path: Path, cfg: Config, tokens: dict[str, int] | None) -> None:
    """Refuse a checkpoint trained on other data (another seed, sequence length, file);
    ``tokens``: the training and validation tokens ``cfg``'s data gives (None for markov)."""
    try:
        extra = read_manifest(path).get("extra") or {}
    except (CheckpointError, OSError):
        return  # load_checkpoint says what is wrong with it
    saved = extra.get("config")
    if not isinstance(saved, dict):
        return  # saved by the library directly: nothing to compare
    why = data_mismatch(saved, cfg, tokens, extra.get("data_tokens"))
    if why is not None:
        raise ConfigError(f"trainer.resume: {path}: {why}")


def load_resume_checkpoint(candidates: list[Path], model: nn.Module, opt: torch.optim.Optimizer, cfg: Config,
                           tokens: dict[str, int] | None, group: Any,
                           notes: list[str]) -> tuple[Path, LoadedCheckpoint]:
    """Load the first loadable candidate into ``model`` and ``opt`` (collective; a damaged newest
    one falls back to the previous, saying so in ``notes``); its ``extra`` is checked."""
    for i, path in enumerate(candidates):
        check_same_data(path, cfg, tokens)
        try:
            info = load_checkpoint(path, model, opt, process_group=group)
        except CheckpointFormatError as e:
            if i + 1 < len(candidates):
                notes.append(f"checkpoint {path} cannot be loaded ({e}); trying the previous one")
                continue
            raise ConfigError(f"trainer.resume: {e}") from None
        except CheckpointError as e:
            lines = str(e).splitlines()
            if len(lines) > 6:  # e.g. every mismatched parameter: the first few say enough
                lines = [*lines[:6], f"  ... and {len(lines) - 6} more"]
            raise ConfigError("trainer.resume: " + "\n".join(lines)) from None
        check_extra(info.extra, info.world_size, path)
        return path, info
    raise AssertionError("unreachable")


def newest_checkpoint_state(root: Path, is_main: bool) -> str:
    """After a failed save: whether the newest complete checkpoint under ``root`` -- the one a
    restart resumes from -- is intact (sizes and SHA-256 verified), as a clause of the error
    message. Rank 0 checks and says it (other ranks get "" unless there is none)."""
    kept = list_checkpoints(root)
    if not kept:
        return "there is no earlier checkpoint"
    if not is_main:
        return ""  # rank 0 checks and says it
    try:
        verify_files(kept[0], read_manifest(kept[0]))
        return f"the newest complete checkpoint {kept[0]} is intact (sizes and SHA-256 verified)"
    except (CheckpointError, OSError) as bad:
        return f"the newest complete checkpoint {kept[0]} fails verification: {bad}"

"""Cross-key checks of a training config: impossible combinations and out-of-range values.

Each check raises :class:`ConfigError` with a message naming the key(s) and what would be
valid. Types and choices were already checked while the config was read (config.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fp8shard.train.config import Config, ConfigError

SEED_LIMIT = 2**32
"""Seeds lie in [0, 2**32): NumPy refuses negative seeds and torch's wrap above 2**64."""
TIMEOUT_LIMIT_S = 365 * 86400.0
"""trainer.collective_timeout_s at most a year (a datetime.timedelta of the process group)."""
MARGIN_LIMIT = 32
"""model.fp8_margin below 32: 2**-32 takes even the amax below the smallest FP8 value of E5M2."""
PATH_ROOM = 64
"""Bytes the run appends to its run directory's path (checkpoints/.tmp-step_00000000/__0_0.distcp ...)."""


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of the config tree."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value


def _finite(cfg: Config) -> None:
    """Every number is finite: YAML reads .nan and .inf, and no key means anything by them."""
    for key, value in _leaves(cfg):
        for i, v in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(v, float) and not math.isfinite(v):
                where = f"{key}[{i}]" if isinstance(value, list) else key
                raise ConfigError(f"{where} must be a finite number, got {v}")


def _bounded(cfg: Config) -> None:
    """Upper bounds that do not come from memory (those are in budget.py)."""
    for key, value in (("model.seed", cfg.model.seed), ("data.seed", cfg.data.seed)):
        if not 0 <= value < SEED_LIMIT:
            raise ConfigError(f"{key} must be in [0, 2**32), got {value}")
    if cfg.trainer.collective_timeout_s > TIMEOUT_LIMIT_S:
        raise ConfigError(f"trainer.collective_timeout_s must be at most {TIMEOUT_LIMIT_S:.0f} (a year), "
                          f"got {cfg.trainer.collective_timeout_s:g}")
    if cfg.model.fp8_margin >= MARGIN_LIMIT:
        raise ConfigError(f"model.fp8_margin must be < {MARGIN_LIMIT}, got {cfg.model.fp8_margin}: a scale "
                          f"of 2**-{MARGIN_LIMIT} rounds even the largest value to zero in every FP8 format")


def _positive(cfg: Config) -> None:
    for key, value in [
        ("trainer.max_steps", cfg.trainer.max_steps),
        ("trainer.val_check_interval", cfg.trainer.val_check_interval),
        ("trainer.limit_val_batches", cfg.trainer.limit_val_batches),
        ("trainer.log_every_n_steps", cfg.trainer.log_every_n_steps),
        ("trainer.max_consecutive_skips", cfg.trainer.max_consecutive_skips),
        ("trainer.collective_timeout_s", cfg.trainer.collective_timeout_s),
        ("model.micro_batch_size", cfg.model.micro_batch_size),
        ("model.global_batch_size", cfg.model.global_batch_size),
        ("model.num_layers", cfg.model.num_layers),
        ("model.hidden_size", cfg.model.hidden_size),
        ("model.ffn_hidden_size", cfg.model.ffn_hidden_size),
        ("model.num_attention_heads", cfg.model.num_attention_heads),
        ("model.fp8_amax_history_len", cfg.model.fp8_amax_history_len),
        ("model.optim.lr", cfg.model.optim.lr),
        ("model.optim.eps", cfg.model.optim.eps),
        ("model.optim.bucket_cap_mb", cfg.model.optim.bucket_cap_mb),
        ("model.init_method_std", cfg.model.init_method_std),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
    ]:
        if not value > 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if cfg.trainer.num_threads != "auto" and cfg.trainer.num_threads <= 0:
        raise ConfigError(f"trainer.num_threads must be auto or > 0, got {cfg.trainer.num_threads}")
    for key, value in [
        ("trainer.gradient_clip_val", cfg.trainer.gradient_clip_val),
        ("model.optim.weight_decay", cfg.model.optim.weight_decay),
        ("model.optim.sched.warmup_steps", cfg.model.optim.sched.warmup_steps),
        ("model.optim.sched.min_lr", cfg.model.optim.sched.min_lr),
        ("model.optim.sched.max_steps", cfg.model.optim.sched.max_steps),
        ("model.fp8_margin", cfg.model.fp8_margin),
        ("model.max_position_embeddings", cfg.model.max_position_embeddings),
        ("checkpoint.every_n_steps", cfg.checkpoint.every_n_steps),
    ]:
        if not value >= 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    factor = cfg.trainer.fp8_overflow_factor
    if factor != 0 and not factor >= 1:
        raise ConfigError(f"trainer.fp8_overflow_factor must be 0 (off) or >= 1, got {factor}")
    for key, value in [("model.hidden_dropout", cfg.model.hidden_dropout),
                       ("model.attention_dropout", cfg.model.attention_dropout)]:
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {value}")


def _devices(cfg: Config, world_size: int) -> None:
    t = cfg.trainer
    if t.devices != "auto" and t.devices != world_size:
        how = ("launch with torchrun --nproc-per-node " + str(t.devices)) if t.devices > 1 else \
              "launch without torchrun or set trainer.devices=auto"
        raise ConfigError(f"trainer.devices={t.devices} but {world_size} process(es) were launched: {how}")
    if t.accelerator == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.accelerator=gpu but CUDA is not available here; "
                              "valid choices: cpu, auto (or run on a GPU machine)")
        # one GPU per rank: checked by init_distributed, before the process group


def _batch(cfg: Config, world_size: int) -> None:
    m = cfg.model
    per_step = m.micro_batch_size * world_size
    if m.global_batch_size % per_step:
        raise ConfigError(
            f"model.global_batch_size ({m.global_batch_size}) must be divisible by "
            f"model.micro_batch_size ({m.micro_batch_size}) x world size ({world_size}) = {per_step}"
        )
    if m.encoder_seq_length < 2:
        raise ConfigError(f"model.encoder_seq_length must be >= 2, got {m.encoder_seq_length}")
    if m.max_position_embeddings and m.max_position_embeddings < m.encoder_seq_length:
        raise ConfigError(
            f"model.max_position_embeddings ({m.max_position_embeddings}) must be 0 or >= "
            f"model.encoder_seq_length ({m.encoder_seq_length})"
        )


def _shape(cfg: Config) -> None:
    m = cfg.model
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size ({m.hidden_size}) must be divisible by "
                          f"model.num_attention_heads ({m.num_attention_heads})")
    if m.position_embedding_type == "rope" and (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError("model.position_embedding_type=rope needs an even head dim "
                          "(model.hidden_size / model.num_attention_heads)")


def _fp8(cfg: Config) -> None:
    m = cfg.model
    if m.fp8_params and not m.fp8:
        raise ConfigError("model.fp8_params=true needs model.fp8=true (FP8 weights are only used by "
                          "FP8 GEMMs); set model.fp8=true or model.fp8_params=false")
    if m.fp8_params and m.optim.name != "distributed_fused_adam":
        raise ConfigError("model.fp8_params=true needs model.optim.name=distributed_fused_adam (it keeps "
                          "the FP32 master weights); valid with adamw: model.fp8_params=false")


def _strategy(cfg: Config, world_size: int) -> None:
    """trainer.strategy=fsdp2: what the FSDP2 engine does not do (docs/engines.md)."""
    t, o = cfg.trainer, cfg.model.optim
    if t.hsdp_replicate < 1 or world_size % t.hsdp_replicate:
        raise ConfigError(f"trainer.hsdp_replicate={t.hsdp_replicate} must be >= 1 and divide the "
                          f"{world_size} rank(s)")
    if t.strategy != "fsdp2":
        if t.hsdp_replicate != 1:
            raise ConfigError("trainer.hsdp_replicate needs trainer.strategy=fsdp2")
        return
    from fp8shard.train.builders import params_dtype

    fp32_params = params_dtype(cfg) == torch.float32
    problems = [
        (o.name != "distributed_fused_adam",
         "model.optim.name must stay distributed_fused_adam (its optimizer math runs on FSDP2's shards)"),
        (world_size < 2,
         "it shards over 2+ ranks; launch with torchrun --nproc-per-node N (N >= 2) or use "
         "trainer.strategy=flat for one process"),
        (t.compile is True, "trainer.compile=true is not supported with it yet; set "
                            "trainer.compile=false (or auto, which leaves an fsdp2 run eager)"),
        (o.overlap_param_sync, "model.optim.overlap_param_sync does not apply (FSDP2 prefetches its "
                               "own all-gathers); set it to false"),
        (o.grad_sync_dtype == "fp32" and not fp32_params,
         "FSDP2 reduces gradients in the parameters' dtype: for fp32 gradient sync set "
         "model.params_dtype=fp32, or model.optim.grad_sync_dtype=bf16"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(f"trainer.strategy=fsdp2: {why}")
    _fsdp2_tiled_weights(cfg, world_size // t.hsdp_replicate)


def _fsdp2_tiled_weights(cfg: Config, shard_world: int) -> None:
    """Rowwise or blockwise FP8 weights under FSDP2: the block projections' rows must cut into
    whole tiles over the shard ranks ([Note: FSDP2 tiled weights]), checked before building."""
    m = cfg.model
    if not (m.fp8_params and m.fp8_recipe in ("rowwise", "blockwise")):
        return
    from fp8shard.fp8.fsdp import check_tiled_sharding, fitting_shard_worlds

    block = (1, 1) if m.fp8_recipe == "rowwise" else (128, 128)
    shapes = m.projection_shapes()
    fits = fitting_shard_worlds(list(shapes.values()), block)
    for name, shape in shapes.items():
        try:
            check_tiled_sharding(shape, block, shard_world, name, fits)
        except ValueError as e:
            raise ConfigError(f"trainer.strategy=fsdp2 with model.fp8_recipe={m.fp8_recipe} "
                              f"model.fp8_params=true: {e}") from None


def _optim(cfg: Config) -> None:
    o = cfg.model.optim
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"model.optim.betas must be two numbers in [0, 1), got {o.betas}")
    if o.sched.min_lr > o.lr:
        raise ConfigError(f"model.optim.sched.min_lr ({o.sched.min_lr}) must be <= model.optim.lr ({o.lr})")


def _data(cfg: Config) -> None:
    d = cfg.data
    if d.source in ("text", "tokens"):
        if not d.path:
            raise ConfigError(f"data.source={d.source} needs data.path (the file to read)")
        _readable_file("data.path", d.path)
    if d.tokenizer is not None:
        if d.source not in ("text", "tokens"):
            raise ConfigError("data.tokenizer is only used with data.source=text or data.source=tokens "
                              "(the generated corpus has no text)")
        if d.tokenizer != "bytes":
            _readable_file("data.tokenizer", d.tokenizer)
            from fp8shard.data.tokenizer import BPETokenizer, TokenizerError

            try:
                BPETokenizer(d.tokenizer)
            except TokenizerError as e:
                raise ConfigError(f"data.tokenizer: {e}") from None
    if d.source == "markov":
        if d.vocab_size < 2:
            raise ConfigError(f"data.vocab_size must be >= 2 for data.source=markov, got {d.vocab_size}")
        for key, value in (("data.markov_order", d.markov_order), ("data.markov_classes", d.markov_classes)):
            if value < 1:
                raise ConfigError(f"{key} must be >= 1, got {value}")
        if d.markov_order > cfg.model.encoder_seq_length:
            raise ConfigError(f"data.markov_order ({d.markov_order}) must be <= model.encoder_seq_length "
                              f"({cfg.model.encoder_seq_length}): a dependency longer than a training "
                              "sequence cannot be learned")
        if not 0 <= 2 * d.markov_spread + 1 <= d.vocab_size:
            raise ConfigError(f"data.markov_spread must be in [0, (data.vocab_size - 1) / 2], "
                              f"got {d.markov_spread}")
        if d.markov_concentration <= 0:
            raise ConfigError(f"data.markov_concentration must be > 0, got {d.markov_concentration}")
        need = (cfg.model.encoder_seq_length + 1) * 2
        if d.num_train_tokens < need or d.num_val_tokens < need:
            raise ConfigError(f"data.num_train_tokens and data.num_val_tokens must be >= {need} "
                              f"(two sequences of model.encoder_seq_length + 1)")
    if d.vocab_size < 0:
        raise ConfigError(f"data.vocab_size must be >= 0, got {d.vocab_size}")
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {d.val_fraction}")


def _readable_file(key: str, path: str) -> None:
    if os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is a directory, not a file")
    if not os.path.exists(path):
        raise ConfigError(f"{key}: no such file {path!r}")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: {path!r} is not a regular file (a device, pipe or socket)")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{key}: {path!r} is not readable (permission denied)")


def _checkpoint(cfg: Config) -> None:
    resume = cfg.trainer.resume
    if not isinstance(resume, bool) and resume not in ("auto", "never") and not os.path.isdir(resume):
        raise ConfigError(f"trainer.resume: {resume!r} is neither auto, never, nor an existing checkpoint "
                          "directory (or a directory holding checkpoints)")
    if cfg.trainer.overwrite and resume in (True, "auto"):
        raise ConfigError("trainer.overwrite=true needs trainer.resume=never: with resume=auto the run "
                          "would delete the checkpoints it continues from")
    horizon = cfg.model.optim.sched.max_steps
    if horizon and horizon < cfg.trainer.max_steps:
        raise ConfigError(f"model.optim.sched.max_steps ({horizon}) must be 0 or >= trainer.max_steps "
                          f"({cfg.trainer.max_steps}): the schedule would end before the run")


def _run_dir(cfg: Config) -> None:
    """The run directory is exp_dir/name and the command writes nothing outside it: ``name`` is
    one directory name, so it cannot point elsewhere (``..``, an absolute path, a nested path)."""
    name = cfg.exp_manager.name
    seps = [c for c in ("/", os.sep, os.altsep) if c]
    if not name.strip() or name in (".", "..") or any(c in name for c in seps) or "\0" in name:
        raise ConfigError(
            f"exp_manager.name must be one directory name (no '/', not '.' or '..'), got {name!r}: "
            "the run directory is exp_manager.exp_dir/exp_manager.name and every file the run writes "
            "goes inside it; to put runs elsewhere set exp_manager.exp_dir")
    if not cfg.exp_manager.exp_dir.strip():
        raise ConfigError("exp_manager.exp_dir must not be empty (use . for the current directory)")
    if "\0" in cfg.exp_manager.exp_dir:
        raise ConfigError("exp_manager.exp_dir must not hold a NUL character")
    run_dir = Path(cfg.exp_manager.exp_dir).absolute() / name
    existing = run_dir
    while not _exists(existing) and existing != existing.parent:
        existing = existing.parent
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    for part in run_dir.parts[1:]:
        if len(os.fsencode(part)) > name_max:
            which = "exp_manager.name" if part == name else "a directory name in exp_manager.exp_dir"
            raise ConfigError(f"{which} is {len(os.fsencode(part))} bytes long ({part[:40]}...); the file "
                              f"system allows at most {name_max} bytes per name")
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)
    if len(os.fsencode(str(run_dir))) + PATH_ROOM > path_max:
        raise ConfigError(f"exp_manager.exp_dir/exp_manager.name: the run directory's path is "
                          f"{len(os.fsencode(str(run_dir)))} bytes; with the {PATH_ROOM} bytes the run "
                          f"appends inside it (checkpoints/...) it exceeds the system's limit of {path_max}")
    if existing != run_dir or _exists(run_dir):
        if not existing.is_dir():
            key = "exp_manager.exp_dir/exp_manager.name" if existing == run_dir else "exp_manager.exp_dir"
            raise ConfigError(f"{key}: {existing} exists and is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"exp_manager.exp_dir: {existing} is not writable (permission denied or a "
                              "read-only file system)")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name or path too long for the file system: it does not exist
        return False


def _pathconf(path: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(path if path.is_dir() else path.parent, name))
    except (OSError, ValueError):
        return default


def _compile(cfg: Config) -> None:
    t = cfg.trainer
    if t.compile_mode == "default":
        return
    on_gpu = t.accelerator == "gpu" or (t.accelerator == "auto" and torch.cuda.is_available())
    if not on_gpu:
        raise ConfigError(f"trainer.compile_mode={t.compile_mode} replays CUDA graphs and needs a GPU; "
                          "set trainer.compile_mode=default on CPU")
    if t.compile is False or t.strategy != "flat":
        raise ConfigError(f"trainer.compile_mode={t.compile_mode} applies to a compiled flat-engine run; "
                          "set trainer.compile=true (or auto) with trainer.strategy=flat, or "
                          "trainer.compile_mode=default")


def validate(cfg: Config, world_size: int) -> None:
    """Raise ConfigError for the first problem found in ``cfg`` run on ``world_size`` ranks."""
    _finite(cfg)
    _positive(cfg)
    _bounded(cfg)
    _devices(cfg, world_size)
    _batch(cfg, world_size)
    _shape(cfg)
    _fp8(cfg)
    _optim(cfg)
    _strategy(cfg, world_size)
    _compile(cfg)
    _data(cfg)
    _checkpoint(cfg)
    _run_dir(cfg)
    from fp8shard.train.budget import check_memory

    check_memory(cfg, world_size)  # last: it needs the shapes checked above

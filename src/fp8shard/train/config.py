"""The training configuration: dataclasses (one docstring per field), YAML and overrides.

Sources, later ones win: the dataclass schema's defaults, ``defaults.yaml`` next to this file,
an optional preset (``config=PATH`` or ``--config PATH``, a YAML holding only the keys it
changes), then ``key=value`` overrides in NeMo/Hydra syntax (``model.optim.lr=3e-4``; values are
read as YAML, so ``model.optim.betas=[0.9,0.95]`` works). Key names follow NeMo's
``megatron_gpt_config.yaml`` wherever one exists.

Every problem -- an unknown key, a wrong type, a value outside its choices, an impossible
combination -- raises :class:`ConfigError` whose message names the key and what is valid; the
command prints it and exits with status 2.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from fp8shard.models.shape import TransformerShape

DEFAULTS_PATH = Path(__file__).with_name("defaults.yaml")
PRESETS_DIR = Path(__file__).with_name("presets")


class ConfigError(ValueError):
    """A configuration problem; its message is meant for the user, without a traceback."""


# ---------------------------------------------------------------------------- the schema
@dataclasses.dataclass
class TrainerConfig:
    """How long to train and on what."""

    devices: int | Literal["auto"] = "auto"
    """Processes (ranks): 'auto' takes what the launcher gave; an int must equal torchrun's
    --nproc-per-node."""
    accelerator: Literal["cpu", "gpu", "auto"] = "auto"
    """cpu (gloo), gpu (one CUDA device per rank, NCCL) or auto (gpu when CUDA is available)."""
    max_steps: int = 300
    """Optimizer steps to run."""
    val_check_interval: int = 100
    """Validate every this many steps (and always after the last step)."""
    limit_val_batches: int = 4
    """Validation uses this many global batches of held-out windows (the same set at any world size)."""
    log_every_n_steps: int = 10
    """Write a metrics.jsonl record and a progress line every this many steps."""
    gradient_clip_val: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    precision: Literal["bf16-mixed", "32"] = "bf16-mixed"
    """bf16-mixed: non-FP8 ops run under bf16 autocast; 32: everything outside FP8 in fp32."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the model in place (same module tree and state-dict keys); what is compiled
    is trainer.compile_scope. auto: on for GPU runs (the fast path there), off on CPU (compiling
    costs more than it saves at CPU sizes). docs/training.md, 'Compiling'."""
    compile_scope: Literal["auto", "model", "graph", "blocks"] = "auto"
    """With compile on: model (the whole model, one graph per region: embeddings, each block,
    final norm + output layer + loss; gradient reduce-scatters overlap the backward), graph (the
    whole model as one graph: reduce-scatters start after the whole backward), blocks (only the
    blocks; embeddings, head and loss eager) or auto: graph on one process (nothing to overlap,
    and fusion across the regions' boundaries is the gain), model on several."""
    compile_mode: Literal["default", "reduce-overhead"] = "default"
    """With compile on, on a GPU: default, or reduce-overhead (the compiled graphs replayed as CUDA
    graphs: fewer kernel launches from the host; each step marks its start for them)."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """With compile=true: the torch.compile backend; inductor generates kernels, aot_eager and
    eager trace without generating code (tests, debugging)."""
    triton: bool = True
    """Let fp8shard's Triton kernels (FP8 casts, the fused optimizer step) serve the calls they can
    (CUDA, triton installed); false: the PyTorch reference paths everywhere (to measure or debug
    them). Sets fp8shard.set_triton for the process."""
    resume: bool | str = "auto"
    """auto (or true): continue from the newest complete checkpoint of the run directory, if any;
    never (or false): start fresh (refused when the run directory holds checkpoints); or a
    checkpoint path (or a directory holding checkpoints) to start from."""
    overwrite: bool = False
    """With resume=never: start fresh in a run directory that holds an earlier run's checkpoints
    (complete or not), deleting them, its metrics.jsonl and summary.json first; without it such
    a directory is refused. docs/reliability.md."""
    max_consecutive_skips: int = 10
    """A step whose loss or gradients are not finite is skipped (nothing changes); after this
    many skipped steps in a row the run stops with an error (docs/reliability.md)."""
    collective_timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks before the run fails with an error
    naming it (the process-group timeout); turns a hung rank into an error."""
    num_threads: int | Literal["auto"] = "auto"
    """CPU threads per rank (torch.set_num_threads). auto: OMP_NUM_THREADS if set (torchrun sets 1
    for 2+ ranks), else the CPUs this process may use divided by the ranks on this node."""
    fp8_overflow_factor: float = 4.0
    """Delayed scaling: report (with the layer's name) an FP8 cast whose amax exceeds what its
    scale can represent (fmt.max / scale) by more than this factor; milder saturation is only
    counted (fp8_saturated). 1 reports every saturated cast; 0 turns the check off."""
    strategy: Literal["flat", "fsdp2"] = "flat"
    """Who owns the weights and moves them: flat (DistributedFusedAdam's buckets, the seed's path)
    or fsdp2 (torch FSDP2's fully_shard with the same FP8 weights, scales and optimizer math;
    needs 2+ ranks and model.optim.name=distributed_fused_adam). docs/engines.md."""
    hsdp_replicate: int = 1
    """trainer.strategy=fsdp2: replicas of the model (HSDP, a replicate x shard mesh); 1: shard
    over every rank. Must divide the number of ranks."""


@dataclasses.dataclass
class SchedConfig:
    """Learning-rate schedule: linear warmup, then cosine decay to min_lr at max_steps."""

    name: Literal["CosineAnnealing", "constant"] = "CosineAnnealing"
    """CosineAnnealing (warmup + cosine) or constant (warmup, then flat)."""
    warmup_steps: int = 30
    """Steps of linear warmup to model.optim.lr (cut to trainer.max_steps in shorter runs)."""
    min_lr: float = 1.0e-4
    """Learning rate reached at the end of the schedule."""
    max_steps: int = 0
    """Length of the schedule in steps (cosine reaches min_lr there); 0: trainer.max_steps. Set it
    to stop a run early on the same schedule."""


@dataclasses.dataclass
class OptimConfig:
    """The optimizer."""

    name: Literal["distributed_fused_adam", "adamw"] = "distributed_fused_adam"
    """distributed_fused_adam (fp8shard's ZeRO optimizer) or adamw (torch AdamW + DDP, the baseline)."""
    lr: float = 3.0e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not biases, norms or position tables)."""
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.95])
    """Adam's (beta1, beta2)."""
    eps: float = 1.0e-8
    """Adam's epsilon."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size (distributed_fused_adam buckets; DDP's bucket_cap_mb for adamw)."""
    overlap_grad_sync: bool = True
    """distributed_fused_adam: start gradient reduce-scatters during backward."""
    grad_sync_dtype: Literal["bf16", "fp32"] = "bf16"
    """distributed_fused_adam: dtype of the gradient reduce-scatter."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """distributed_fused_adam: dtype of the Adam moments (bf16 halves their memory)."""
    overlap_param_sync: bool = False
    """distributed_fused_adam: step() returns with the parameter all-gathers in flight; each
    module's forward waits for its own."""
    fused: bool = True
    """distributed_fused_adam: take the fused Triton step (update, amax and FP8 cast in one pass)
    where Triton serves (trainer.triton, CUDA); false: the PyTorch step (to compare, or to debug)."""
    sched: SchedConfig = dataclasses.field(default_factory=SchedConfig)
    """Learning-rate schedule."""


@dataclasses.dataclass
class BatchShape:
    """Sequences and tokens per step (the first keys of the model section)."""

    micro_batch_size: int = 8
    """Sequences per rank per forward/backward."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all ranks; a multiple of micro_batch_size x world size
    (the factor left over is gradient accumulation)."""
    encoder_seq_length: int = 128
    """Tokens per training sequence."""
    max_position_embeddings: int = 0
    """Position table length; 0 means encoder_seq_length."""


@dataclasses.dataclass
class ModelConfig(TransformerShape, BatchShape):
    """The GPT, its batch shape and its FP8 settings. The model's shape is
    ``fp8shard.models.TransformerShape``, declared once for this section and ``GPTConfig``;
    the keys come in the order batch shape, transformer shape, then the fields below."""

    params_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """dtype of the non-FP8 model parameters; auto: bf16 with distributed_fused_adam + bf16-mixed
    (the optimizer keeps fp32 masters), else fp32."""
    fp8: bool = True
    """Run the block projections' GEMMs in FP8 (fp8_autocast)."""
    fp8_params: bool = True
    """Store the block projection weights as FP8 parameters (fp8_model_init); needs fp8 and
    distributed_fused_adam."""
    fp8_hybrid: bool = True
    """HYBRID recipe: E4M3 forward, E5M2 gradients; false: E4M3 everywhere."""
    fp8_recipe: Literal["delayed", "current", "tensorwise", "rowwise", "blockwise"] = "delayed"
    """Scaling: delayed (per-tensor, amax history, Transformer Engine's), current or tensorwise
    (per-tensor amax of each cast), rowwise (one scale per row of each GEMM operand, torchao's) or
    blockwise (1x128 activation/gradient tiles, 128x128 weight blocks, DeepSeek-V3's); with
    model.fp8_params=true rowwise and blockwise store their weights with one scale per row or per
    128x128 block (with trainer.strategy=fsdp2: rows cut into whole tiles over the shard ranks,
    docs/engines.md). docs/fp8.md, 'Scaling recipes'."""
    fp8_layers: Literal["auto", "all"] = "auto"
    """Which block projections compute in FP8 under model.fp8: auto (on a GPU only those large
    enough for FP8 to be faster than bf16, fs.nn.fp8_gemm_pays: none of GPT-2 small's, all four
    at 1.3B; the others compute in bf16 from their weights, which stay FP8 with
    model.fp8_params; on the CPU all of them) or all. docs/nn.md, 'Which layers compute in FP8'."""
    fp8_gemm: Literal["auto", "scaled_mm", "emulated"] = "auto"
    """How FP8 GEMMs run: auto (GPU: torch._scaled_mm; CPU: the emulated path unless a one-time
    measurement shows torch._scaled_mm is not slower, since some CPUs serve it with a reference
    kernel hundreds of times slower), scaled_mm (always torch._scaled_mm) or emulated (FP8 inputs
    widened to fp32, product in fp32). docs/nn.md, 'Which GEMM path'."""
    fp8_margin: int = 0
    """Delayed scaling: scale = fmt.max / amax / 2**margin."""
    fp8_amax_history_len: int = 16
    """Delayed scaling: amaxes kept per tensor."""
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"
    """Delayed scaling: reduce the history by its max or take the newest."""
    seed: int = 1234
    """Seed of the model init and of dropout (the data has its own, data.seed)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """The optimizer."""


@dataclasses.dataclass
class DataConfig:
    """Where the tokens come from."""

    source: Literal["auto", "markov", "text", "tokens"] = "auto"
    """auto: markov without data.path, else picked from the file (tokens for a folder or file made
    by `python -m fp8shard.data prepare`, text for UTF-8 text); markov: a generated corpus with a
    known entropy floor; text: a UTF-8 file (bytes, or a tokenizers JSON); tokens: a pre-tokenized
    binary file."""
    path: str | None = None
    """text: the text file; tokens: the .bin file of token ids, or the folder prepare wrote."""
    tokenizer: str | None = None
    """A Hugging Face `tokenizers` JSON file, or bytes (UTF-8 byte ids); null: byte-level for text,
    ids without text for tokens (a prepared tokens file names its own)."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """tokens: element type of the file."""
    vocab_size: int = 256
    """markov: alphabet size; tokens: the vocabulary size (0: max token id + 1)."""
    markov_order: int = 2
    """markov: how many previous tokens the next token depends on."""
    markov_classes: int = 4
    """markov: number of next-token offset distributions the older context chooses between."""
    markov_spread: int = 2
    """markov: the next token is succ(previous) shifted by an offset in [-spread, spread]."""
    markov_concentration: float = 0.3
    """markov: Dirichlet concentration of the offset distributions (lower: lower entropy floor)."""
    num_train_tokens: int = 2000000
    """markov: tokens generated for training."""
    num_val_tokens: int = 100000
    """markov: tokens generated for validation (an independent stream)."""
    val_fraction: float = 0.05
    """text/tokens: the last this fraction of the tokens is held out for validation."""
    seed: int = 1234
    """Seed of the generated corpus and of the order of the training windows."""


@dataclasses.dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint) in <run dir>/checkpoints; docs/checkpoint.md."""

    every_n_steps: int = 0
    """Save every this many steps and after the last step; 0: never."""
    keep_last: int = 2
    """Keep this many most recent complete checkpoints (older ones are deleted after each save)."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """A save that fails (disk full, permission denied) publishes nothing and leaves the earlier
    checkpoints untouched; stop: exit 1 with one line; continue: say so and train on (the next
    save tries again; a failed save after the last step always stops). docs/reliability.md."""


@dataclasses.dataclass
class ExpManagerConfig:
    """Where the run directory goes: exp_dir/name."""

    exp_dir: str = "runs"
    """Parent directory of run directories."""
    name: str = "gpt"
    """Run name; the run directory is exp_dir/name (overwritten files if it exists)."""
    plots: bool = True
    """Draw the report's PNG plots into the run directory at the end (needs matplotlib)."""
    create_tensorboard_logger: bool = False
    """Also write the logged scalars (loss, lr, tokens/s, grad norm, skipped steps, validation loss,
    bytes per step) as TensorBoard events into the run directory (needs tensorboard)."""


@dataclasses.dataclass
class Config:
    """The whole training job."""

    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """How long to train and on what."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The GPT, its batch shape, FP8 settings and optimizer."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Where the tokens come from."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Sharded checkpoints."""
    exp_manager: ExpManagerConfig = dataclasses.field(default_factory=ExpManagerConfig)
    """The run directory."""


# ---------------------------------------------------------------------------- introspection
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass and of its dataclass bases (read
    from their source; a subclass's wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for node, nxt in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, type, doc) of every leaf key, in schema order."""
    out: list[tuple[str, Any, str]] = []
    docs, hints = field_docs(cls), _hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(iter_keys(tp, key + "."))
        else:
            out.append((key, tp, docs.get(f.name, "")))
    return out


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------------------- coercion
def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` as type ``tp``, or a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        text = str(value).lower() if isinstance(value, bool) else str(value)
        for c in choices:
            if text == str(c):
                return c
        raise ConfigError(f"{key}: {text!r} is not one of: {', '.join(map(str, choices))}")
    if origin in (Union, types.UnionType):
        errors = []
        for alt in typing.get_args(tp):
            try:
                return _coerce(value, alt, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None or value == "null":
            return None
        raise ConfigError(f"{key}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list like [0.9, 0.95], got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # a schema bug, not a user error


def _unknown_key(key: str, part: str, cls: type, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(part, names, n=1)
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
    where = prefix.rstrip(".") or "the top level"
    return ConfigError(f"unknown key '{key}'.{hint} Valid keys in {where}: {', '.join(names)}")


def _set(obj: Any, key: str, value: Any) -> None:
    """Set dotted ``key`` on the dataclass tree ``obj``, coercing ``value`` to the field type."""
    parts = key.split(".")
    prefix = ""
    for i, part in enumerate(parts):
        cls = type(obj)
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            raise _unknown_key(key, part, cls, prefix)
        tp = _hints(cls)[part]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                if isinstance(value, dict):
                    for k, v in value.items():
                        _set(getattr(obj, part), str(k), v)
                    return
                raise ConfigError(f"'{key}' is a section, not a value; set its keys, e.g. "
                                  f"{key}.{dataclasses.fields(tp)[0].name}=...")
            obj = getattr(obj, part)
            prefix += part + "."
        elif not last:
            raise ConfigError(f"'{prefix}{part}' is a value, not a section (in '{key}')")
        else:
            setattr(obj, part, _coerce(value, tp, key))


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.extend(_flatten(v, f"{prefix}{k}."))
        else:
            out.append((f"{prefix}{k}", v))
    return out


def apply_yaml(cfg: Config, path: str | Path) -> None:
    """Apply the keys of a YAML file (nested mappings) onto ``cfg``."""
    p = Path(path)
    if not p.exists() and not p.suffix and (PRESETS_DIR / f"{p}.yaml").exists():
        p = PRESETS_DIR / f"{p}.yaml"  # config=gpt_125m names a shipped preset
    if not p.exists():
        presets = ", ".join(sorted(x.stem for x in PRESETS_DIR.glob("*.yaml")))
        raise ConfigError(f"config: no such file {str(path)!r} (shipped presets: {presets})")
    if p.is_dir():
        raise ConfigError(f"config: {p} is a directory, not a YAML file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config: {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config: cannot read {p}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {p} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {p} must hold a mapping of sections, got {type(data).__name__}")
    for key, value in _flatten(data):
        _set(cfg, key, value)


def parse_value(text: str) -> Any:
    """An override's value, read as YAML (``true``, ``3``, ``[0.9,0.95]``, ``null``)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def split_args(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """argv -> (preset paths, [(key, raw value)]). Accepts ``--config P``/``config=P``."""
    presets: list[str] = []
    overrides: list[tuple[str, str]] = []
    it = iter(argv)
    for arg in it:
        if arg in ("--config", "-c"):
            nxt = next(it, None)
            if nxt is None:
                raise ConfigError("--config needs a path, e.g. --config presets/gpt_125m.yaml")
            presets.append(nxt)
        elif arg.startswith("--config="):
            presets.append(arg.split("=", 1)[1])
        elif "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            key = key.lstrip("+")
            if key == "config":
                presets.append(value)
            else:
                overrides.append((key, value))
        else:
            raise ConfigError(f"bad argument {arg!r}: expected key=value (e.g. model.fp8=true), "
                              f"config=PATH, or --help")
    return presets, overrides


def load_config(argv: list[str], world_size: int | None = None, validate_cfg: bool = True) -> Config:
    """defaults.yaml, then presets, then overrides; validated for ``world_size`` ranks."""
    cfg = Config()
    apply_yaml(cfg, DEFAULTS_PATH)
    presets, overrides = split_args(argv)
    for p in presets:
        apply_yaml(cfg, p)
    for key, raw in overrides:
        if not key:
            raise ConfigError(f"bad override '={raw}': the key is empty")
        _set(cfg, key, parse_value(raw))
    if validate_cfg:
        from fp8shard.data.prepared import resolve_data  # data.source=auto, prepared tokens files
        from fp8shard.train.validate import validate

        resolve_data(cfg.data)

        validate(cfg, world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def help_text() -> str:
    """What ``python -m fp8shard.train --help`` prints: usage and every key with its doc."""
    defaults = Config()
    apply_yaml(defaults, DEFAULTS_PATH)
    lines = [
        "usage: python -m fp8shard.train [config=PRESET.yaml] [key=value ...]",
        "       torchrun --nproc-per-node N -m fp8shard.train [key=value ...]",
        "",
        "Trains a GPT; writes exp_manager.exp_dir/exp_manager.name/{config.yaml, metrics.jsonl,",
        "summary.json, plots/}. Values are YAML: model.fp8=false model.optim.betas=[0.9,0.95].",
        f"Presets shipped: {', '.join(sorted(p.stem for p in PRESETS_DIR.glob('*.yaml')))} "
        "(config=gpt_125m).",
        "",
        "keys (default) -- meaning:",
    ]
    flat = dict(_flatten(to_dict(defaults)))
    for key, tp, doc in iter_keys():
        value = yaml.safe_dump(flat[key], default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"  {key}={value}  [{type_name(tp)}]")
        lines.append(f"      {doc}")
    return "\n".join(lines)

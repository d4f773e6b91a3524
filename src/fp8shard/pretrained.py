"""A trained run as a model to use: its checkpoint, configuration, GPTConfig and tokenizer.

``open_pretrained(PATH)`` takes a checkpoint, a run directory (its newest checkpoint) or a
checkpoints folder, and rebuilds everything from what the training command saved -- the
training configuration inside the checkpoint (or the run's config.yaml), the vocabulary from
the checkpoint's embedding, the tokenizer copied into the run directory ([Note: prepared
tokens]) -- so export, generate and evaluate never rebuild ``GPTConfig`` by hand::

    from fp8shard.pretrained import open_pretrained
    run = open_pretrained("runs/gpt")            # newest checkpoint of the run
    model = run.model()                          # fp32 GPT from the FP32 masters, eval mode
    ids = run.tokenizer.encode("To be")          # the tokenizer the tokens were made with

Two ways to compute:

* ``run.model(source, dtype)``: a plain high-precision GPT (no FP8) from the optimizer's FP32
  masters (``source="master"``, the default when the checkpoint has them) or from the weights
  the run computed with (``"weights"``: FP8 bytes dequantized): what an export holds.
* ``run.trained_model()``: the GPT as the run built it (FP8 weights, the FP8 recipe, bf16
  autocast) with ``run.forward_context()``: what the run's validation computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from fp8shard.checkpoint import CheckpointError, read_manifest, resolve_checkpoint
from fp8shard.data.prepared import RUN_TOKENIZER, run_tokenizer
from fp8shard.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from fp8shard.models import GPT, GPTConfig
from fp8shard.train.config import Config, ConfigError, _flatten, _set

Source = Literal["master", "weights"]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32,
           "bfloat16": torch.bfloat16}


class PretrainedError(ValueError):
    """A run or checkpoint cannot be used as a model; the message is meant for the user."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise PretrainedError(f"dtype must be fp32 or bf16, got {name!r}") from None


def config_from_dict(data: dict[str, Any]) -> Config:
    """A Config from a saved one; keys this version lacks are skipped unless they shape the model."""
    cfg = Config()
    for key, value in _flatten(data):
        try:
            _set(cfg, key, value)
        except ConfigError:
            if key.startswith("model.") and not key.startswith("model.optim"):
                raise PretrainedError(f"the run's configuration has {key}={value!r}, which this version of "
                                      "fp8shard cannot build") from None
    return cfg


def find_checkpoint(path: str | Path) -> tuple[Path, Path | None]:
    """(checkpoint, run directory or None) for a checkpoint, a run directory or a checkpoints folder."""
    p = Path(path)
    try:
        if (p / "checkpoints").is_dir() and not (p / "manifest.json").exists():
            ck = resolve_checkpoint(p / "checkpoints")
        else:
            ck = resolve_checkpoint(p)
    except CheckpointError as e:
        hint = "" if (p / "checkpoints").is_dir() or not (p / "config.yaml").exists() else \
            " (the run saved none: train with checkpoint.every_n_steps=N)"
        raise PretrainedError(f"{e}{hint}") from None
    run_dir = ck.parent.parent if ck.parent.name == "checkpoints" else None
    if run_dir is not None and not (run_dir / "config.yaml").exists():
        run_dir = None
    return ck, run_dir


@dataclasses.dataclass
class Pretrained:
    """What a run left, ready to compute with. Build it with :func:`open_pretrained`."""

    checkpoint: Path
    run_dir: Path | None
    config: Config
    """The training configuration (model shape and precision, data, batch)."""
    gpt_config: GPTConfig
    tokenizer: Tokenizer | None
    """Text <-> ids; None when the tokens stand for no text (the generated corpus)."""
    tokenizer_spec: str | None
    """``bytes``, the tokenizer file used, or None."""
    step: int | None
    manifest: dict[str, Any]

    @property
    def has_master(self) -> bool:
        opt = self.manifest.get("optimizer") or {}
        return opt.get("kind") == "distributed_fused_adam" and bool(opt.get("params"))

    def resolve_source(self, source: Source | Literal["auto"] = "auto") -> Source:
        """``auto``: the FP32 master when the checkpoint has one, else the weights."""
        if source == "auto":
            return "master" if self.has_master else "weights"
        if source == "master" and not self.has_master:
            raise PretrainedError(f"{self.checkpoint} holds no FP32 master weights (its optimizer was "
                                  f"{(self.manifest.get('optimizer') or {}).get('kind', 'not saved')}): "
                                  "use the weights (--source weights)")
        return source

    def state_dict(self, source: Source | Literal["auto"] = "auto", dtype: str | torch.dtype = "fp32"
                   ) -> dict[str, torch.Tensor]:
        """The model's parameters under fp8shard's names, as plain tensors of ``dtype``."""
        from fp8shard.checkpoint import read_model_state

        return read_model_state(self.checkpoint, source=self.resolve_source(source), dtype=parse_dtype(dtype))

    def model(self, source: Source | Literal["auto"] = "auto", dtype: str | torch.dtype = "fp32",
              device: str | torch.device = "cpu") -> GPT:
        """A high-precision GPT (no FP8) with the checkpoint's values, in eval mode."""
        sd = self.state_dict(source, dtype)
        with torch.device("meta"):
            model = GPT(self.gpt_config)
        model.to_empty(device=device)
        model.init_buffers()
        model.load_state_dict(sd, strict=True)
        return model.to(parse_dtype(dtype)).eval()

    def trained_model(self, device: str | torch.device = "cpu") -> GPT:
        """The GPT as the run built it (FP8 weights when it had them), with the checkpoint's
        weights and FP8 scaling state, in eval mode; compute under :meth:`forward_context`."""
        from fp8shard.checkpoint import load_model_weights
        from fp8shard.train.builders import build_model

        model = build_model(self.config, self.gpt_config.vocab_size, torch.device(device))
        load_model_weights(self.checkpoint, model, hp_from_master=False)
        return model.eval()

    def amax_sync(self, model: torch.nn.Module) -> Any:
        """An ``fs.nn.AmaxSync`` of ``model`` (from :meth:`trained_model`) when the run used
        delayed scaling, else None: give it to :meth:`forward_context` to update the scales after
        each forward, as the run's validation did ([Note: amax reduction])."""
        import fp8shard as fs
        from fp8shard.train.builders import build_recipe

        if self.config.model.fp8 and isinstance(build_recipe(self.config), fs.DelayedScaling):
            return fs.nn.AmaxSync(model)
        return None

    def forward_context(self, device: str | torch.device = "cpu",
                        amax_sync: Any = None) -> contextlib.ExitStack:
        """The run's autocast: bf16 outside the FP8 GEMMs (trainer.precision=bf16-mixed) and
        fp8_autocast with the run's recipe (model.fp8), as its validation used them; with
        ``amax_sync`` (:meth:`amax_sync`) its ``step()`` runs at the end, after the forward."""
        import fp8shard as fs
        from fp8shard.train.builders import build_recipe

        stack = contextlib.ExitStack()
        if amax_sync is not None:
            stack.callback(amax_sync.step)  # registered first: runs last, after the autocasts
        if self.config.trainer.precision == "bf16-mixed":
            stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
        if self.config.model.fp8:
            stack.enter_context(fs.fp8_autocast(enabled=True, recipe=build_recipe(self.config)))
        return stack

    def describe(self) -> str:
        g = self.gpt_config
        tok = {None: "token ids (no text)", "bytes": "UTF-8 bytes"}.get(self.tokenizer_spec,
                                                                     f"BPE {self.tokenizer_spec}")
        return (f"{self.checkpoint} (step {self.step}): GPT {g.num_layers} layers x {g.hidden_size}, "
                f"{g.num_attention_heads} heads, vocabulary {g.vocab_size}, "
                f"context {g.max_position_embeddings}; tokenizer: {tok}")


def _find_tokenizer(spec: str | None, run_dir: Path | None, override: str | None) -> str | None:
    if override is not None:
        return None if override == "none" else override
    if spec is None or spec == "bytes":
        return spec
    if run_dir is not None and (run_dir / RUN_TOKENIZER).is_file():
        return str(run_dir / RUN_TOKENIZER)
    if Path(spec).is_file():
        return spec
    raise PretrainedError(f"the run's tokens were made with the tokenizer {spec}, which is not there any "
                          "more (nor a copy in the run directory): pass --tokenizer PATH")


def open_pretrained(path: str | Path, tokenizer: str | None = None) -> Pretrained:
    """The run or checkpoint at ``path`` as a :class:`Pretrained`.

    ``tokenizer`` overrides the run's: ``bytes``, a tokenizers JSON file, or ``none``.
    """
    ck, run_dir = find_checkpoint(path)
    try:
        manifest = read_manifest(ck)
    except CheckpointError as e:
        raise PretrainedError(str(e)) from None
    saved = (manifest.get("extra") or {}).get("config")
    if isinstance(saved, dict):
        cfg = config_from_dict(saved)
    elif run_dir is not None:
        cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
    else:
        raise PretrainedError(f"cannot rebuild the model of {ck}: the checkpoint holds no training "
                              "configuration (it was not saved by python -m fp8shard.train) and no "
                              "config.yaml is beside it")
    wte = (manifest.get("model") or {}).get("wte.weight")
    if wte is None:
        raise PretrainedError(f"{ck} holds no 'wte.weight': not a checkpoint of fp8shard's GPT")
    from fp8shard.train.builders import gpt_config

    try:
        gcfg = gpt_config(cfg, int(wte["shape"][0]))
    except ValueError as e:
        raise PretrainedError(f"the run's model configuration is invalid: {e}") from None
    spec = _find_tokenizer(run_tokenizer(cfg), run_dir, tokenizer)
    try:
        tok = load_tokenizer(spec)
    except TokenizerError as e:
        raise PretrainedError(str(e)) from None
    if tok is not None and tok.vocab_size > gcfg.vocab_size:
        raise PretrainedError(f"the tokenizer {spec} has {tok.vocab_size} ids but the model only "
                              f"{gcfg.vocab_size}: not the tokenizer the run was trained with")
    step = manifest.get("step")
    return Pretrained(ck, run_dir, cfg, gcfg, tok, spec, None if step is None else int(step), manifest)

"""``python -m fp8shard.export CKPT --to safetensors|hf``: a trained model in files others load.

``CKPT`` is a checkpoint, a run directory (its newest checkpoint) or a checkpoints folder; the
model configuration and tokenizer come from the run (``fp8shard.pretrained``).

* ``--to safetensors``: ``OUT/model.safetensors`` under fp8shard's parameter names, the
  ``GPTConfig`` as JSON in the file's metadata (``fp8shard.gpt_config``; rebuild with
  ``GPT(GPTConfig(**json.loads(...)))``), and the tokenizer file beside it;
* ``--to hf``: a Hugging Face folder -- ``config.json`` (GPT-2), ``model.safetensors``
  under GPT-2's names, ``tokenizer.json`` and ``tokenizer_config.json`` -- that
  ``transformers.GPT2LMHeadModel.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)``
  load. Only for models of GPT-2's architecture: learned absolute positions, LayerNorm,
  GELU (tanh), tied embeddings, biases ([Note: GPT-2 layout]).

``--source master`` (default when the checkpoint has one) exports the optimizer's FP32 masters,
``--source weights`` what the run computed with (FP8 weights dequantized); ``--dtype fp32``
(default) keeps every value exactly, ``--dtype bf16`` rounds to bf16. Nothing is pickled:
every file is JSON or safetensors.

[Note: GPT-2 layout]
    fp8shard's GPT and GPT-2 compute the same function when the architecture matches: pre-norm
    blocks, a fused QKV projection whose output is (q, k, v) each split into heads in order,
    GELU with the tanh approximation (``gelu_new``), a final LayerNorm, and the output layer
    tied to the token embedding. GPT-2 stores its projections as ``Conv1D`` weights of shape
    (in, out), the transpose of ``nn.Linear``'s (out, in); the names map as

        wte / wpe / final_norm            -> transformer.wte / wpe / ln_f
        blocks.i.norm1 / norm2            -> transformer.h.i.ln_1 / ln_2
        blocks.i.attn.qkv / proj          -> transformer.h.i.attn.c_attn / c_proj   (weights transposed)
        blocks.i.mlp.fc1 / fc2            -> transformer.h.i.mlp.c_fc / c_proj      (weights transposed)

    and ``lm_head.weight`` is left to ``tie_word_embeddings``. tests/test_use.py checks the
    logits against ``transformers`` on the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import fp8shard
from fp8shard.pretrained import Pretrained, PretrainedError, open_pretrained, parse_dtype

PROG = "python -m fp8shard.export"

GPT2_ARCHITECTURE = (
    ("position_embedding_type", "learned_absolute", "learned absolute positions"),
    ("normalization", "layernorm", "LayerNorm"),
    ("activation", "gelu", "a GELU MLP"),
    ("share_embeddings_and_output_weights", True, "the output layer tied to the embedding"),
    ("bias", True, "biases"),
)
"""(model key, the value GPT-2 needs, what GPT2LMHeadModel has)."""


class ExportError(ValueError):
    """The export cannot be made; the message is meant for the user (one line)."""


def _yaml_value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def gpt2_incompatibilities(pre: Pretrained) -> list[str]:
    """``model.KEY=value (GPT-2 has ...)`` for each option GPT-2's architecture lacks."""
    g = pre.gpt_config
    return [f"model.{key}={_yaml_value(getattr(g, key))} (GPT2LMHeadModel has {what})"
            for key, want, what in GPT2_ARCHITECTURE if getattr(g, key) != want]


def to_gpt2_names(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """fp8shard's parameters under GPT-2's names and layouts ([Note: GPT-2 layout])."""
    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"],
           "transformer.ln_f.weight": sd["final_norm.weight"], "transformer.ln_f.bias": sd["final_norm.bias"]}
    pairs = (("norm1", "ln_1", False), ("norm2", "ln_2", False), ("attn.qkv", "attn.c_attn", True),
             ("attn.proj", "attn.c_proj", True), ("mlp.fc1", "mlp.c_fc", True),
             ("mlp.fc2", "mlp.c_proj", True))
    for i in range(num_layers):
        for ours, theirs, conv1d in pairs:
            w = sd[f"blocks.{i}.{ours}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if conv1d else w
            out[f"transformer.h.{i}.{theirs}.bias"] = sd[f"blocks.{i}.{ours}.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def gpt2_config(pre: Pretrained, dtype: torch.dtype) -> dict[str, Any]:
    """A transformers ``GPT2Config`` as JSON for the run's model."""
    g, m = pre.gpt_config, pre.config.model
    eot = None if pre.tokenizer is None else pre.tokenizer.eot_id
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": g.vocab_size, "n_positions": g.max_position_embeddings, "n_embd": g.hidden_size,
        "n_layer": g.num_layers, "n_head": g.num_attention_heads, "n_inner": g.ffn_hidden_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": g.layernorm_epsilon,
        "initializer_range": g.init_method_std, "resid_pdrop": m.hidden_dropout, "embd_pdrop": 0.0,
        "attn_pdrop": m.attention_dropout, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True, "bos_token_id": eot, "eos_token_id": eot,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "fp8shard": _provenance(pre),
    }


def _provenance(pre: Pretrained) -> dict[str, Any]:
    return {"version": fp8shard.__version__, "checkpoint": str(pre.checkpoint), "step": pre.step,
            "gpt_config": dataclasses.asdict(pre.gpt_config)}


def _write_json(path: Path, data: Any) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ExportError("exporting needs the `safetensors` package: pip install safetensors "
                          "(or pip install 'fp8shard[export]')") from None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # safetensors creates its file readable by the owner only
    os.replace(tmp, path)
    return path


def _tokenizer_files(pre: Pretrained, out: Path, hf: bool) -> list[Path]:
    """The tokenizer beside the weights: a BPE's tokenizer.json; for byte-level ids, in a Hugging
    Face folder, the equivalent tokenizer.json (a BPE without merges: id = byte)."""
    tok = pre.tokenizer
    if tok is None:
        return []
    written = []
    if tok.kind == "bpe":
        assert tok.path is not None
        dst = out / "tokenizer.json"
        if not (dst.exists() and dst.resolve() == tok.path.resolve()):
            shutil.copyfile(tok.path, dst)
        written.append(dst)
    elif hf:
        from fp8shard.data.tokenizer import TokenizerError, bytes_as_bpe_json

        try:
            text = bytes_as_bpe_json()
        except TokenizerError as e:
            raise ExportError(f"{e} (to write the byte-level tokenizer for transformers)") from None
        (out / "tokenizer.json").write_text(text)
        written.append(out / "tokenizer.json")
    if hf:
        from fp8shard.data.tokenizer import EOT

        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "model_max_length": pre.gpt_config.max_position_embeddings,
                                  "clean_up_tokenization_spaces": False}
        if tok.eot_id is not None:
            config.update(bos_token=EOT, eos_token=EOT)
        written.append(_write_json(out / "tokenizer_config.json", config))
    return written


def export(pre: Pretrained, out: Path, to: str = "safetensors", source: str = "auto",
           dtype: str | torch.dtype = "fp32") -> list[Path]:
    """Write the run's model into the folder ``out``; returns the files written."""
    if to not in ("safetensors", "hf"):
        raise ExportError(f"--to must be safetensors or hf, got {to!r}")
    if to == "hf":
        bad = gpt2_incompatibilities(pre)
        if bad:
            raise ExportError(f"--to hf writes GPT2LMHeadModel, whose architecture this model does not have: "
                              f"{'; '.join(bad)}; export it with --to safetensors instead")
    src = pre.resolve_source(source)  # type: ignore[arg-type]
    dt = parse_dtype(dtype)
    sd = pre.state_dict(src, dt)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"fp8shard.source": src, "fp8shard.dtype": str(dt).removeprefix("torch."),
            "fp8shard.checkpoint": str(pre.checkpoint), "fp8shard.step": str(pre.step),
            "producer": f"fp8shard {fp8shard.__version__}", "format": "pt"}
    if to == "safetensors":
        meta["fp8shard.gpt_config"] = json.dumps(dataclasses.asdict(pre.gpt_config))
        spec = pre.tokenizer_spec
        meta["fp8shard.tokenizer"] = {None: "none", "bytes": "bytes"}.get(spec, "tokenizer.json")
        files = [_save_safetensors(sd, out / "model.safetensors", meta)]
    else:
        tensors = to_gpt2_names(sd, pre.gpt_config.num_layers)
        files = [_save_safetensors(tensors, out / "model.safetensors", meta),
                 _write_json(out / "config.json", gpt2_config(pre, dt))]
    return files + _tokenizer_files(pre, out, to == "hf")


def default_out(pre: Pretrained, to: str) -> Path:
    if pre.run_dir is not None:
        return pre.run_dir / "export" / to
    return pre.checkpoint.parent / f"{pre.checkpoint.name}-{to}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Export a trained model: safetensors with the model config in its "
                               "metadata, or a Hugging Face GPT-2 folder (config.json, model.safetensors, "
                               "tokenizer) that transformers.GPT2LMHeadModel.from_pretrained loads.")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint, a run directory (its newest checkpoint) "
                                                      "or a checkpoints folder")
    p.add_argument("--to", choices=("safetensors", "hf"), required=True, help="what to write")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: RUN_DIR/export/safetensors or RUN_DIR/export/hf)")
    p.add_argument("--source", choices=("auto", "master", "weights"), default="auto",
                   help="master: the optimizer's FP32 master weights; weights: what the run computed with "
                        "(FP8 dequantized); auto (default): master when the checkpoint has it")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the exported tensors (default fp32: no rounding)")
    p.add_argument("--tokenizer", default=None,
                   help="override the run's tokenizer: a tokenizers JSON file, bytes, or none")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        pre = open_pretrained(args.checkpoint, tokenizer=args.tokenizer)
        out = args.out or default_out(pre, args.to)
        files = export(pre, out, args.to, args.source, args.dtype)
    except (PretrainedError, ExportError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    src = pre.resolve_source(args.source)  # type: ignore[arg-type]
    print(f"exported {pre.checkpoint} (step {pre.step}), {src} weights in {args.dtype}, to {out}:")
    for f in files:
        print(f"  {f.name}")
    if pre.tokenizer is None:
        print("  (no tokenizer: the run's tokens stand for no text)")
    if args.to == "hf":
        print(f"load with: transformers.GPT2LMHeadModel.from_pretrained({str(out)!r})")
    else:
        print(f"load with: safetensors.torch.load_file({str(out / 'model.safetensors')!r}); the GPTConfig is "
              "in its metadata under fp8shard.gpt_config")
    return 0


if __name__ == "__main__":
    sys.exit(main())

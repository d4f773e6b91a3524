"""``python -m fp8shard.evaluate CKPT [--data PATH]``: loss, perplexity and bits per byte of a run.

Without ``--data`` it evaluates the windows the run validated on (the first
``trainer.limit_val_batches x model.global_batch_size`` windows of its validation split), with
the model computing as the run did (``--precision trained``: FP8 weights, the FP8 recipe and
bf16 autocast), so it prints the run's validation loss again; exactly for a run on one rank,
to the last digits for several (each rank's delayed-scaling state evolved with its own
windows). ``--data PATH`` evaluates every window of another file instead: UTF-8 text (tokenized
with the run's tokenizer) or a tokens file made by ``python -m fp8shard.data prepare`` with the
same tokenizer. ``--precision fp32`` computes with the FP32 master weights and no FP8, as an
export does. Bits per byte are printed when the tokens stand for text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp8shard.data.prepared import (
    bits_per_byte_factor,
    detect_source,
    meta_tokenizer,
    read_meta,
    token_bytes,
    val_targets,
)
from fp8shard.pretrained import Pretrained, PretrainedError, open_pretrained
from fp8shard.train.config import ConfigError

PROG = "python -m fp8shard.evaluate"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_tokenizer(pre: Pretrained, spec: str) -> bool:
    mine = pre.tokenizer_spec
    if mine is None:  # ids without text: nothing to compare
        return True
    if mine == "bytes" or spec == "bytes":
        return mine == spec
    return _sha256(Path(mine)) == _sha256(Path(spec))


def data_tokens(pre: Pretrained, path: str) -> np.ndarray:
    """Every token of ``path`` in the run's ids (text is encoded with the run's tokenizer)."""
    try:
        source = detect_source(path)
    except ConfigError as e:
        raise PretrainedError(str(e).removeprefix("data.path: ")) from None
    if source == "text":
        if pre.tokenizer is None:
            raise PretrainedError(f"{path} is text, but this run's tokens stand for no text")
        text = Path(path).read_text(encoding="utf-8")
        return np.asarray(pre.tokenizer.encode(text), dtype=np.int64)
    p = Path(path) / "tokens.bin" if Path(path).is_dir() else Path(path)
    meta = read_meta(p)
    if meta is None:
        raise PretrainedError(f"{path} holds token ids without a tokens.json saying how they were made; "
                              "make it with python -m fp8shard.data prepare")
    if not _same_tokenizer(pre, meta_tokenizer(p, meta)):
        raise PretrainedError(f"{path} was tokenized with {meta_tokenizer(p, meta)}, not with the run's "
                              f"tokenizer ({pre.tokenizer_spec}): evaluate the text itself instead")
    return np.asarray(np.memmap(p, dtype=np.dtype(meta["dtype"]), mode="r"))


def run_validation_tokens(pre: Pretrained) -> tuple[np.ndarray, int]:
    """The run's validation stream and the number of windows its validation used."""
    from fp8shard.train.data import load_data

    cfg = pre.config
    try:
        data = load_data(cfg.data, cfg.model.encoder_seq_length)
    except (ConfigError, OSError) as e:
        raise PretrainedError(f"cannot read the run's data again ({str(e).splitlines()[0]}); give the file "
                              "with --data PATH") from None
    world = int(pre.manifest.get("world_size") or 1)
    n = cfg.trainer.limit_val_batches * cfg.model.global_batch_size
    seq = cfg.model.encoder_seq_length
    used = min(n, (len(data.val) - 1) // seq) // world * world
    return np.asarray(data.val), used


@torch.no_grad()
def evaluate(pre: Pretrained, tokens: np.ndarray, num_windows: int, precision: str = "trained",
             micro_batch_size: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Mean loss over the first ``num_windows`` windows of ``tokens`` (as the run's validation
    cuts them: window i = tokens[i T : i T + T + 1]), with perplexity and bits per byte."""
    from fp8shard.train.data import val_batches

    seq = pre.config.model.encoder_seq_length
    available = (len(tokens) - 1) // seq
    n = min(num_windows, available)
    if n < 1:
        raise PretrainedError(f"the data holds {len(tokens)} tokens: not one window of {seq + 1}")
    if precision == "trained":
        model = pre.trained_model(device)
        sync = pre.amax_sync(model)  # delayed scaling: scales updated after each forward, as validated
        ctx = lambda: pre.forward_context(device, sync)
    else:
        model = pre.model(dtype=precision, device=device)
        ctx = None
    mb = micro_batch_size or pre.config.model.micro_batch_size
    total = count = 0.0
    for x, y, _ in val_batches(tokens, seq, n, mb, 0, 1, device):  # one rank: no padding
        if ctx is None:
            loss = model(x, y)
        else:
            with ctx():
                loss = model(x, y)
        total += float(loss) * y.numel()
        count += y.numel()
    loss = total / count
    factor = bits_per_byte_factor(token_bytes(pre.tokenizer_spec), val_targets(tokens, seq, n, 1))
    return {"checkpoint": str(pre.checkpoint), "step": pre.step, "precision": precision, "windows": n,
            "tokens": int(count), "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": None if factor is None else loss * factor}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Evaluate a trained model: loss (nats/token), "
                                                       "perplexity and, for text, bits per byte.")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint, a run directory (its newest checkpoint) "
                                                      "or a checkpoints folder")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or prepared tokens file/folder to evaluate on, every window (default: "
                        "the windows the run validated on)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows")
    p.add_argument("--precision", choices=("trained", "fp32", "bf16"), default="trained",
                   help="trained (default): as the run computed (FP8); fp32/bf16: the FP32 master weights "
                        "in that dtype, no FP8 (what an export computes)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="windows per forward (default: the run's)")
    p.add_argument("--tokenizer", default=None,
                   help="override the run's tokenizer: a tokenizers JSON file, bytes, or none")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        pre = open_pretrained(args.checkpoint, tokenizer=args.tokenizer)
        if args.data is None:
            tokens, n = run_validation_tokens(pre)
            what = "the run's validation windows"
        else:
            tokens, n = data_tokens(pre, args.data), sys.maxsize
            what = str(args.data)
        if args.max_windows is not None:
            n = min(n, args.max_windows)
        result = evaluate(pre, tokens, n, args.precision, args.micro_batch_size, args.device)
    except PretrainedError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    result["data"] = what
    line = (f"loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.2f}")
    if result["bits_per_byte"] is not None:
        line += f", {result['bits_per_byte']:.4f} bits/byte"
    print(f"{pre.checkpoint} (step {pre.step}, precision {args.precision}) on {what}: "
          f"{result['windows']} windows, {result['tokens']:,} tokens")
    print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokens files made from text, and how the training command finds what a data file holds.

[Note: prepared tokens]
    ``python -m fp8shard.data prepare INPUT... --out DIR`` writes three files into DIR:

    * ``tokens.bin``: the token ids of every input document, in order, as little-endian uint16
      (uint32 past 65,536 ids); a BPE separates documents with its end-of-text id;
    * ``tokenizer.json``: the byte-level BPE trained on those documents (absent for byte-level
      ids, which need no file);
    * ``tokens.json``: what the ids are -- format and version, element type, vocabulary size,
      the tokenizer (``"tokenizer.json"`` or ``"bytes"``), counts of tokens, bytes and
      documents, the input files.

    ``data.path=DIR`` (or ``DIR/tokens.bin``) then needs nothing else: the training command
    reads the element type, vocabulary and tokenizer from ``tokens.json``
    (:func:`resolve_data`), records them in the run's config.yaml, and copies the tokenizer
    into the run directory, where export, generate and evaluate find it.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from fp8shard.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer, train_bpe
from fp8shard.train.config import Config, ConfigError, DataConfig

FORMAT = "fp8shard-tokens"
VERSION = 1
TOKENS_FILE, META_FILE, TOKENIZER_FILE = "tokens.bin", "tokens.json", "tokenizer.json"
RUN_TOKENIZER = "tokenizer.json"
"""Name of the copy of a run's tokenizer in its run directory."""


class PrepareError(ValueError):
    """``prepare`` cannot go on; the message is meant for the user (one line)."""


@dataclasses.dataclass
class Prepared:
    """What ``prepare`` wrote."""

    out: Path
    tokens: Path
    meta: dict[str, Any]


# ---------------------------------------------------------------------------- prepare
def input_files(inputs: list[Path], pattern: str = "*.txt") -> list[Path]:
    """Files named, and files under folders matching ``pattern`` (recursively, sorted)."""
    files: list[Path] = []
    for p in inputs:
        if p.is_dir():
            found = sorted(f for f in p.rglob(pattern) if f.is_file())
            if not found:
                raise PrepareError(f"{p} holds no file matching {pattern!r} (choose others with --pattern)")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise PrepareError(f"no such file or folder: {p}")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare(inputs: list[Path], out: Path, *, tokenizer: str = "bpe", vocab_size: int = 4096,
            min_frequency: int = 2, pattern: str = "*.txt") -> Prepared:
    """Tokenize text files (or folders of them) into ``out`` ([Note: prepared tokens])."""
    if tokenizer not in ("bpe", "bytes"):
        raise PrepareError(f"--tokenizer must be bpe or bytes, got {tokenizer!r}")
    files = input_files(inputs, pattern)
    total_bytes = sum(len(_read_text(f).encode("utf-8")) for f in files)  # all UTF-8 before any work
    if total_bytes == 0:
        raise PrepareError("the input files hold no text (0 bytes)")
    out.mkdir(parents=True, exist_ok=True)
    tok_path = out / TOKENIZER_FILE
    if tokenizer == "bpe":
        try:
            tok = train_bpe((_read_text(f) for f in files), vocab_size, tok_path, min_frequency)
        except TokenizerError as e:
            raise PrepareError(str(e)) from None
        arrays = []
        for f in files:
            if arrays and tok.eot_id is not None:
                arrays.append(np.array([tok.eot_id], dtype=np.int64))
            arrays.append(np.asarray(tok.encode(_read_text(f)), dtype=np.int64))
        vocab, name = tok.vocab_size, TOKENIZER_FILE
    else:
        if tok_path.exists():
            tok_path.unlink()  # a BPE from an earlier prepare would contradict tokens.json
        arrays = [np.frombuffer(_read_text(f).encode("utf-8"), dtype=np.uint8).astype(np.int64)
                  for f in files]
        vocab, name = 256, "bytes"
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    tokens = out / TOKENS_FILE
    tmp = tokens.with_name(f".{TOKENS_FILE}.tmp-{os.getpid()}")
    ids.astype(dtype).tofile(tmp)
    os.replace(tmp, tokens)
    meta = {
        "format": FORMAT, "version": VERSION, "dtype": np.dtype(dtype).name, "vocab_size": vocab,
        "tokenizer": name, "tokenizer_sha256": _sha256(tok_path) if tokenizer == "bpe" else None,
        "num_tokens": len(ids), "num_bytes": total_bytes, "documents": len(files),
        "bytes_per_token": round(total_bytes / max(len(ids), 1), 4),
        "inputs": [str(f) for f in files[:1000]],
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return Prepared(out, tokens, meta)


# ---------------------------------------------------------------------------- reading
def meta_path(tokens: Path) -> Path:
    """The description beside a tokens file: ``X.json`` for ``X.bin``."""
    return tokens.with_suffix(".json")


def read_meta(tokens: str | Path) -> dict[str, Any] | None:
    """The ``tokens.json`` of a prepared tokens file (or folder), or None when there is none."""
    p = Path(tokens)
    if p.is_dir():
        p = p / TOKENS_FILE
    m = meta_path(p)
    if p.suffix == ".json" or not m.is_file():
        return None
    try:
        meta = json.loads(m.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    if meta.get("version", 0) > VERSION or meta.get("dtype") not in ("uint16", "uint32"):
        raise ConfigError(f"data.path: {m} was written by a newer fp8shard (version {meta.get('version')}) "
                          "or is damaged; prepare the data again")
    return meta


def meta_tokenizer(tokens: Path, meta: dict[str, Any]) -> str:
    """The tokenizer named by a prepared file's description: ``bytes`` or a path beside it."""
    name = str(meta.get("tokenizer") or "bytes")
    return name if name == "bytes" else str(tokens.parent / name)


def _looks_like_text(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(1 << 16)
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a cut last character is fine
    except UnicodeDecodeError:
        return False
    return True


def detect_source(path: str) -> str:
    """``text`` or ``tokens``: what ``data.path`` holds, for ``data.source=auto``."""
    p = Path(path)
    if p.is_dir():
        if (p / TOKENS_FILE).is_file():
            return "tokens"
        raise ConfigError(f"data.path: {p} is a folder without {TOKENS_FILE}; make one from its text files "
                          f"first: python -m fp8shard.data prepare {p} --out DIR, then data.path=DIR")
    if not p.is_file():
        raise ConfigError(f"data.path: no such file {path!r}")
    if read_meta(p) is not None:
        return "tokens"
    if p.stat().st_size and _looks_like_text(p):
        return "text"
    raise ConfigError(f"data.path: cannot tell what {path} holds (not UTF-8 text, and no {meta_path(p).name} "
                      "beside it as `python -m fp8shard.data prepare` writes): set data.source=tokens with "
                      "data.token_dtype for a file of token ids, or data.source=text")


def resolve_data(d: DataConfig) -> None:
    """Settle ``data.source=auto`` and fill in what a prepared tokens file says about itself.

    ``auto``: the generated corpus (markov) without ``data.path``; with one, ``tokens`` for a
    prepared tokens file or folder, ``text`` for a UTF-8 file, else a ConfigError. For a
    prepared file ([Note: prepared tokens]): ``data.path`` becomes the ``.bin`` file,
    ``data.token_dtype`` its element type, ``data.tokenizer`` (when null) its tokenizer, and
    ``data.vocab_size`` at least its vocabulary. The values land in the run's config.yaml.
    """
    if d.source == "auto":
        d.source = "markov" if d.path is None else detect_source(d.path)
    elif d.source == "markov" and d.path is not None:
        raise ConfigError(f"data.path={d.path} is set but data.source=markov generates its corpus and "
                          "ignores it: leave data.source out (it is then picked from the file) or set "
                          "data.source=text|tokens")
    if d.source != "tokens" or d.path is None:
        return
    p = Path(d.path)
    if p.is_dir():
        p = p / TOKENS_FILE
        d.path = str(p)
    meta = read_meta(p)
    if meta is None:
        return
    d.token_dtype = meta["dtype"]
    if d.tokenizer is None:
        d.tokenizer = meta_tokenizer(p, meta)
    if d.vocab_size < int(meta["vocab_size"]):
        d.vocab_size = int(meta["vocab_size"])


# ---------------------------------------------------------------------------- runs
def run_tokenizer(cfg: Config) -> str | None:
    """The tokenizer a run's tokens were made with: ``bytes``, a tokenizers JSON path, or None
    (ids without text: the generated corpus, or a tokens file nobody described)."""
    d = cfg.data
    if d.source == "markov":
        return None
    if d.tokenizer is not None:
        return d.tokenizer
    return "bytes" if d.source == "text" else None


def save_run_tokenizer(cfg: Config, run_dir: Path) -> Path | None:
    """Copy the run's tokenizer file into its run directory (rank 0), so the run directory alone
    is enough to export, generate or evaluate."""
    spec = run_tokenizer(cfg)
    if spec is None or spec == "bytes":
        return None
    dst = run_dir / RUN_TOKENIZER
    src = Path(spec)
    if not (dst.exists() and dst.resolve() == src.resolve()):
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    return dst


def token_bytes(spec: str | None) -> np.ndarray | None:
    """Bytes of text each id stands for, when the tokenizer says ([Note: byte-level tokens])."""
    try:
        tok = load_tokenizer(spec)
    except TokenizerError:
        return None
    if tok is None:
        return None
    return ByteTokenizer().token_bytes() if tok.kind == "bytes" else tok.token_bytes()


def bits_per_byte_factor(table: np.ndarray | None, targets: np.ndarray) -> float | None:
    """``f`` with ``bits per byte = f * mean loss (nats/token)`` over the target ids ``targets``."""
    if table is None or len(targets) == 0:
        return None
    ids = np.asarray(targets, dtype=np.int64)
    n_bytes = int(table[ids[ids < len(table)]].sum())  # ids past the tokenizer's stand for no text
    if n_bytes <= 0:
        return None
    return len(ids) / (n_bytes * math.log(2))


def val_targets(val: np.ndarray, seq_len: int, num_windows: int, world_size: int) -> np.ndarray:
    """The target ids of the validation windows the training command evaluates (``val_batches``:
    the first ``num_windows``, cut to a multiple of the world size)."""
    available = (len(val) - 1) // seq_len
    used = min(num_windows, available) // world_size * world_size
    return np.asarray(val[1:used * seq_len + 1])


def val_bpb_factor(cfg: Config, val: np.ndarray, world_size: int) -> float | None:
    """The training command's bits-per-byte factor of its validation loss (text runs only)."""
    m = cfg.model
    n = cfg.trainer.limit_val_batches * m.global_batch_size
    return bits_per_byte_factor(token_bytes(run_tokenizer(cfg)),
                                val_targets(val, m.encoder_seq_length, n, world_size))

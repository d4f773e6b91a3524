"""Tokenizers of text runs: byte-level ids (no dependency) or a byte-level BPE trained locally.

[Note: byte-level tokens]
    Byte-level ids are the UTF-8 bytes of the text (vocabulary 256). A byte-level BPE (Hugging
    Face ``tokenizers``, GPT-2's scheme) first maps every byte to one printable character (the
    table of :func:`byte_to_char`), then merges frequent pairs; each id therefore stands for a
    fixed string of bytes, so decoding is exact and the bytes behind any stream of ids can be
    counted from the vocabulary alone (:meth:`BPETokenizer.token_bytes`). Bits per byte follow:
    ``loss_nats_per_token * tokens / bytes / ln 2``.

    The BPE's JSON file (``tokenizer.json``) is the Hugging Face format, so the same file serves
    this library, ``tokenizers``, and ``transformers`` (``PreTrainedTokenizerFast``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

EOT = "<|endoftext|>"
"""The document separator a BPE tokenizer trained here reserves (id 0)."""


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or made; the message is meant for the user."""


@functools.cache
def byte_to_char() -> tuple[str, ...]:
    """The printable character standing for each byte value in byte-level BPE vocabularies.

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 (controls,
    space, DEL, NBSP, soft hyphen) get the code points 256, 257, ... in byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return tuple(out)


@functools.cache
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_to_char())}


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("a BPE tokenizer needs the `tokenizers` package: pip install tokenizers "
                             "(or pip install 'fp8shard[text]'); byte-level ids need nothing") from None
    return tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids (vocabulary 256). ``name == "bytes"``."""

    kind = "bytes"
    name = "bytes"
    vocab_size = 256
    eot_id: int | None = None
    path: Path | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)


class BPETokenizer:
    """A Hugging Face ``tokenizers`` JSON file (byte-level BPE when made by ``prepare``).

    The vocabulary, the end-of-text id and the bytes of each id are read from the JSON itself;
    ``tokenizers`` is imported only to encode or decode.
    """

    kind = "bpe"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = str(path)
        try:
            self.spec: dict[str, Any] = json.loads(self.path.read_text(encoding="utf-8"))
            vocab = self.spec["model"]["vocab"]
        except FileNotFoundError:
            raise TokenizerError(f"no tokenizer file {self.path}") from None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise TokenizerError(f"{self.path} is not a Hugging Face tokenizers JSON file") from None
        if not isinstance(vocab, dict):
            raise TokenizerError(f"{self.path}: model.vocab is not a mapping (a BPE/WordLevel vocabulary)")
        self.vocab: dict[str, int] = vocab
        self.added = {t["content"]: int(t["id"]) for t in self.spec.get("added_tokens") or []}
        ids = [*vocab.values(), *self.added.values()]
        self.vocab_size = max(ids) + 1 if ids else 0
        self.eot_id = self.added.get(EOT, vocab.get(EOT))
        self._tok: Any = None

    @property
    def byte_level(self) -> bool:
        """Whether each id stands for a fixed string of bytes ([Note: byte-level tokens])."""
        parts = [self.spec.get("pre_tokenizer") or {}, self.spec.get("decoder") or {}]
        for p in list(parts):
            parts.extend(p.get("pretokenizers") or p.get("decoders") or [])
        return any(p.get("type") == "ByteLevel" for p in parts)

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (imported on first use)."""
        if self._tok is None:
            self._tok = _import_tokenizers().Tokenizer.from_file(str(self.path))
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))

    def token_bytes(self) -> np.ndarray | None:
        """Bytes of text each id stands for (0 for special tokens); None unless byte-level."""
        if not self.byte_level:
            return None
        table = char_to_byte()
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for text, i in self.vocab.items():
            out[i] = sum(1 for c in text if c in table)
        for i in self.added.values():
            out[i] = 0
        return out


Tokenizer = ByteTokenizer | BPETokenizer


def load_tokenizer(spec: str | Path | None) -> Tokenizer | None:
    """``None`` (token ids without text), ``"bytes"``, or the path of a tokenizers JSON file."""
    if spec is None:
        return None
    if str(spec) == "bytes":
        return ByteTokenizer()
    return BPETokenizer(spec)


def train_bpe(texts: Iterable[str], vocab_size: int, out_file: Path, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE on ``texts`` (GPT-2's scheme, id 0 = ``<|endoftext|>``) and save it
    as a tokenizers JSON file."""
    tk = _import_tokenizers()
    if vocab_size < 258:
        raise TokenizerError(f"--vocab-size must be at least 258 (256 bytes, the end-of-text token and "
                             f"one merge), got {vocab_size}")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                     initial_alphabet=list(byte_to_char()), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_file))
    return BPETokenizer(out_file)


def bytes_as_bpe_json() -> str:
    """A tokenizers JSON whose ids are the UTF-8 bytes (a BPE with no merges): the byte-level
    tokenizer in a form ``transformers`` loads."""
    tk = _import_tokenizers()
    vocab = {c: b for b, c in enumerate(byte_to_char())}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    return str(tok.to_str())

"""Token data: a generated Markov corpus with a known entropy floor, text, or token files.

[Note: global batches]
    The training tokens are cut into windows of ``seq_len + 1`` tokens (window i starts at
    token ``i * seq_len``). Sample number ``g`` (counting from 0 over the whole run) is window
    ``perm_e[g mod n]`` where ``e = g // n`` is the epoch and ``perm_e`` a permutation seeded by
    ``(data.seed, e)``. Global batch ``k`` is samples ``[k*G, (k+1)*G)``; rank ``r`` of ``W``
    takes the ``r``-th contiguous slice of ``G/W`` of them and cuts it into micro-batches. So the
    sequence of global batches depends only on the seed and the step, never on the world size,
    ranks never overlap, and the loader's whole state is the number of samples consumed.

[Note: entropy floor]
    The default corpus comes from an order-k Markov chain over V tokens (``MarkovSource``). The
    best any model can do on it is the conditional entropy ``H(X_t | X_{t-k..t-1})``; the floor
    reported is its average along the validation stream, computed exactly from the chain's
    probabilities at each position (so it carries almost no sampling noise). A window's first k
    positions lack part of their context, which lifts the best reachable loss slightly above it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from fp8shard.train.config import ConfigError, DataConfig
from fp8shard.train.faults import TrainingFailure


class DataFileChanged(TrainingFailure):
    """The token file was truncated, replaced or rewritten while the run read it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, every_rank=True)


class TokenFile:
    """A token file read with ``os.pread``, never memory-mapped.

    [Note: token file reads]
        A memory map of a file that another process truncates turns the next read of a page
        past the new end into SIGBUS, which kills the process with no message. So the file is
        opened once and every window is read with ``pread`` into a small array: a read past the
        end comes back short and becomes :class:`DataFileChanged`. Each optimizer step and each
        validation pass also compares the path's ``stat`` (device, inode, size, mtime) with what
        it was at start-up (one system call), so a file replaced (renamed over: the open file
        still reads the old bytes) or rewritten in place is reported too, at the next step,
        instead of silently mixing two data sets. The run stops with one line on every rank
        that sees it and exit status 1 (docs/reliability.md).
    """

    def __init__(self, path: str, dtype: np.dtype) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ConfigError(f"data.path: cannot read {path}: {e.strerror or e}") from None
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.nbytes = st.st_size
        self.length = st.st_size // self.dtype.itemsize

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` as an array of the file's dtype."""
        n = (stop - start) * self.dtype.itemsize
        if n <= 0:
            return np.empty(0, dtype=self.dtype)
        if self.fd is None:
            raise ValueError(f"{self.path} was closed")
        buf = os.pread(self.fd, n, start * self.dtype.itemsize)
        if len(buf) != n:
            self.check()  # says how the file changed
            raise DataFileChanged(self._message(f"a read at byte {start * self.dtype.itemsize} came back "
                                                f"short: the file is shorter than the {self.nbytes} bytes "
                                                "it had at start-up"))
        return np.frombuffer(buf, dtype=self.dtype)

    def check(self) -> None:
        """Raise DataFileChanged if the path no longer names the file, as it was, that was opened."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise DataFileChanged(self._message(f"it can no longer be read ({e.strerror or e})")) from None
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if now == self.ident:
            return
        if now[:2] != self.ident[:2]:
            what = "it was replaced by another file"
        elif now[2] != self.ident[2]:
            what = f"its size went from {self.ident[2]} to {now[2]} bytes"
        else:
            what = "it was rewritten (its modification time changed)"
        raise DataFileChanged(self._message(what))

    def _message(self, what: str) -> str:
        return (f"data.path: {self.path} changed while the run was reading it: {what}; stopping rather "
                "than training on other data (checkpoints written so far are kept: restore the file and "
                "run the same command to resume)")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class TokenSlice:
    """A contiguous range of a :class:`TokenFile` that reads like a 1-D array (``len``, slices)."""

    def __init__(self, file: TokenFile, start: int = 0, stop: int | None = None) -> None:
        self.file, self.start = file, start
        self.stop = file.length if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def dtype(self) -> np.dtype:
        return self.file.dtype

    def __getitem__(self, key: slice) -> np.ndarray:
        """The tokens of a contiguous slice, read from the file."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a TokenSlice takes contiguous slices only")
        lo, hi, _ = key.indices(len(self))
        return self.file.read(self.start + lo, self.start + max(hi, lo))

    def sub(self, lo: int, hi: int) -> TokenSlice:
        """Elements ``[lo, hi)`` of this range, as a range (nothing is read)."""
        return TokenSlice(self.file, self.start + lo, self.start + hi)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.file.read(self.start, self.stop)
        return a if dtype is None else a.astype(dtype)

    def check(self) -> None:
        self.file.check()


Tokens = Union[np.ndarray, TokenSlice]  # noqa: UP007 -- a runtime alias (Python 3.10)


def check_tokens(tokens: Tokens) -> None:
    """For a token file: raise DataFileChanged if it changed since start-up ([Note: token file reads])."""
    if isinstance(tokens, TokenSlice):
        tokens.check()


@dataclasses.dataclass
class TokenData:
    """Training and validation token streams (1-D integer arrays, or ranges of a token file)."""

    train: Tokens
    val: Tokens
    vocab_size: int
    description: str
    entropy_floor: float | None = None
    """Nats per token the best possible model would reach on the validation stream (markov only)."""


# ---------------------------------------------------------------------------- the Markov source
class MarkovSource:
    """A seeded order-k Markov chain whose conditional entropy is known exactly.

    ``x_t = (succ[x_{t-1}] + d) mod V`` where ``succ`` is a random permutation of the
    vocabulary and the offset ``d`` in ``[-spread, spread]`` is drawn from one of ``classes``
    random distributions; which one is picked by the older context,
    ``c = sum_j cls_j[x_{t-j}] mod classes`` for j = 2..k. Given the last k tokens the next
    token is ``succ[x_{t-1}]`` shifted by ``d``, so ``H(X_t | context) = H(offsets of class c)``
    exactly (distinct offsets give distinct tokens while 2 spread + 1 <= V). A model first learns
    the unigram (about ln V), then the successor table (order 1), then the class (order k).
    """

    def __init__(self, vocab_size: int, order: int, classes: int, spread: int, concentration: float,
                 seed: int) -> None:
        self.vocab_size, self.order, self.classes = vocab_size, order, classes
        rng = np.random.default_rng([seed, 0x6D61726B])
        self.succ = rng.permutation(vocab_size)
        self.cls = rng.integers(0, classes, size=(max(order - 1, 1), vocab_size))
        self.offsets = np.arange(-spread, spread + 1)
        self.probs = rng.dirichlet(np.full(len(self.offsets), concentration), size=classes)  # (C, m)
        self.cdf = np.cumsum(self.probs, axis=1)
        p = np.maximum(self.probs, 1e-300)
        self.class_entropy = -(self.probs * np.log(p)).sum(axis=1)  # (C,) nats

    def _class_of(self, ctx: np.ndarray) -> np.ndarray:
        c = np.zeros(len(ctx), dtype=np.int64)
        for j in range(1, self.order):
            c += self.cls[j - 1][ctx[:, j]]
        return c % self.classes

    def sample(self, num_tokens: int, stream: int, chains: int = 1024, min_length: int = 4096,
               burn_in: int = 32) -> tuple[np.ndarray, float]:
        """``num_tokens`` tokens from independent chains laid end to end, and the exact mean
        conditional entropy (nats) at the emitted positions. ``stream`` picks the RNG stream.

        Chains run in parallel (vectorized) and are at least ``min_length`` long, so few
        training windows straddle the jump from one chain to the next."""
        rng = np.random.default_rng([stream, 0x73747265])
        v, k = self.vocab_size, self.order
        chains = max(1, min(chains, num_tokens // min_length))
        length = -(-num_tokens // chains)
        ctx = rng.integers(0, v, size=(chains, k))  # column j = the token j+1 positions back
        out = np.empty((length, chains), dtype=np.uint16 if v <= 65536 else np.uint32)
        ent_sum = 0.0
        for t in range(burn_in + length):
            c = self._class_of(ctx)
            u = rng.random(chains)
            pick = np.minimum((self.cdf[c] < u[:, None]).sum(axis=1), len(self.offsets) - 1)
            nxt = (self.succ[ctx[:, 0]] + self.offsets[pick]) % v
            if t >= burn_in:
                ent_sum += float(self.class_entropy[c].sum())
                out[t - burn_in] = nxt
            ctx = np.roll(ctx, 1, axis=1)
            ctx[:, 0] = nxt
        tokens = out.T.reshape(-1)[:num_tokens]  # chain after chain
        return np.ascontiguousarray(tokens), ent_sum / (length * chains)


def markov_data(cfg: DataConfig) -> TokenData:
    src = MarkovSource(cfg.vocab_size, cfg.markov_order, cfg.markov_classes, cfg.markov_spread,
                       cfg.markov_concentration, cfg.seed)
    train, _ = src.sample(cfg.num_train_tokens, stream=2 * cfg.seed)
    val, floor = src.sample(cfg.num_val_tokens, stream=2 * cfg.seed + 1)
    desc = (f"markov(order={cfg.markov_order}, vocab={cfg.vocab_size}, classes={cfg.markov_classes}, "
            f"spread={cfg.markov_spread}, seed={cfg.seed})")
    return TokenData(train, val, cfg.vocab_size, desc, entropy_floor=floor)


# ---------------------------------------------------------------------------- files
def _split(tokens: Tokens, val_fraction: float, seq_len: int, what: str) -> tuple[Tokens, Tokens]:
    n = len(tokens)
    n_val = max(int(n * val_fraction), seq_len + 1)
    if n - n_val < seq_len + 1:
        raise ConfigError(f"data.path: {what} has {n} tokens, too few for a train/validation "
                          f"split with model.encoder_seq_length={seq_len}")
    if isinstance(tokens, TokenSlice):
        return tokens.sub(0, n - n_val), tokens.sub(n - n_val, n)
    return tokens[:-n_val], tokens[-n_val:]


def _nonempty(path: str) -> int:
    size = Path(path).stat().st_size
    if size == 0:
        raise ConfigError(f"data.path: {path} is empty (0 bytes)")
    return size


def text_data(cfg: DataConfig, seq_len: int) -> TokenData:
    assert cfg.path is not None
    _nonempty(cfg.path)
    try:
        return _text_data(cfg, seq_len)
    except OSError as e:
        raise ConfigError(f"data.path: cannot read {cfg.path}: {e.strerror or e}") from None


def _text_data(cfg: DataConfig, seq_len: int) -> TokenData:
    assert cfg.path is not None
    if cfg.tokenizer in (None, "bytes"):
        tokens = np.fromfile(cfg.path, dtype=np.uint8)  # byte-level: vocab 256
        vocab, how = 256, "bytes"
    else:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("data.tokenizer needs the `tokenizers` package: pip install tokenizers "
                              "(or set data.tokenizer=null for byte-level tokens)") from None
        try:
            tok = Tokenizer.from_file(cfg.tokenizer)
        except Exception as e:  # the library raises its own exception types
            raise ConfigError(f"data.tokenizer: {cfg.tokenizer} is not a tokenizers JSON file "
                              f"({str(e).splitlines()[0][:120]})") from None
        try:
            text = Path(cfg.path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"data.path: {cfg.path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                              "a pre-tokenized file needs data.source=tokens") from None
        ids = tok.encode(text).ids
        vocab, how = tok.get_vocab_size(), f"tokenizer {cfg.tokenizer}"
        tokens = np.asarray(ids, dtype=np.uint32)
    train, val = _split(tokens, cfg.val_fraction, seq_len, cfg.path)
    return TokenData(train, val, vocab, f"text {cfg.path} ({how})")


def token_file_data(cfg: DataConfig, seq_len: int) -> TokenData:
    assert cfg.path is not None
    dtype = np.dtype(cfg.token_dtype)
    size = _nonempty(cfg.path)
    if size % dtype.itemsize:
        raise ConfigError(f"data.path: {cfg.path} has {size} bytes, not a whole number of "
                          f"{cfg.token_dtype} token ids ({dtype.itemsize} bytes each): a text file needs "
                          "data.source=text, another element type data.token_dtype")
    file = TokenFile(cfg.path, dtype)  # [Note: token file reads]: no memory map, no SIGBUS
    try:
        return _token_file_data(cfg, seq_len, file)
    except BaseException:
        file.close()
        raise


def _token_file_data(cfg: DataConfig, seq_len: int, file: TokenFile) -> TokenData:
    assert cfg.path is not None
    tokens = TokenSlice(file)
    chunk = 1 << 22
    top = max(int(file.read(i, min(i + chunk, file.length)).max()) for i in range(0, file.length, chunk))
    vocab = cfg.vocab_size or top + 1
    if top >= vocab:
        raise ConfigError(f"data.path: {cfg.path} holds token id {top}, beyond the vocabulary "
                          f"(data.vocab_size={vocab}: ids 0..{vocab - 1}); set data.vocab_size to at "
                          f"least {top + 1} (0: max id + 1), or check data.token_dtype")
    train, val = _split(tokens, cfg.val_fraction, seq_len, cfg.path)
    return TokenData(train, val, vocab, f"tokens {cfg.path} ({cfg.token_dtype})")


def load_data(cfg: DataConfig, seq_len: int) -> TokenData:
    """The token streams named by ``cfg`` (every rank builds the same, deterministically)."""
    if cfg.source == "auto":  # a DataConfig made in code rather than by load_config
        from fp8shard.data.prepared import resolve_data

        cfg = dataclasses.replace(cfg)
        resolve_data(cfg)
    if cfg.source == "markov":
        return markov_data(cfg)
    if cfg.source == "text":
        return text_data(cfg, seq_len)
    return token_file_data(cfg, seq_len)


# ---------------------------------------------------------------------------- batches
def _window(tokens: Tokens, index: int, seq_len: int) -> np.ndarray:
    start = index * seq_len
    return np.asarray(tokens[start:start + seq_len + 1], dtype=np.int64)


def _to_batch(windows: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(np.stack(windows))  # (B, T+1) int64
    return w[:, :-1].to(device, non_blocking=True), w[:, 1:].to(device, non_blocking=True)


class BatchLoader:
    """This rank's micro-batches of each global batch; see [Note: global batches]."""

    def __init__(self, tokens: Tokens, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 rank: int, world_size: int, seed: int, device: torch.device | str = "cpu") -> None:
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of {seq_len + 1}")
        self.per_rank = global_batch_size // world_size
        self.consumed_samples = 0
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def accumulation_steps(self) -> int:
        return self.per_rank // self.micro_batch_size

    def sample_window(self, g: int) -> int:
        """Window index of global sample number ``g``."""
        epoch, i = divmod(g, self.num_windows)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_windows))
        return int(self._perm[1][i])

    def global_batch_windows(self, step: int) -> list[int]:
        """All window indices of global batch ``step`` (0-based), in rank order."""
        g0 = step * self.global_batch_size
        return [self.sample_window(g0 + j) for j in range(self.global_batch_size)]

    def next_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches ``[(inputs, targets)]`` of the next global batch."""
        check_tokens(self.tokens)  # a token file changed under the run: an error, not other data
        g0 = self.consumed_samples + self.rank * self.per_rank
        windows = [_window(self.tokens, self.sample_window(g0 + j), self.seq_len)
                   for j in range(self.per_rank)]
        self.consumed_samples += self.global_batch_size
        mb = self.micro_batch_size
        return [_to_batch(windows[i:i + mb], self.device) for i in range(0, self.per_rank, mb)]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["seed"] != self.seed or sd["seq_len"] != self.seq_len:
            raise ValueError(f"data loader state is for seed={sd['seed']}, seq_len={sd['seq_len']}; "
                             f"this loader has seed={self.seed}, seq_len={self.seq_len}")
        self.consumed_samples = int(sd["consumed_samples"])


def val_batches(tokens: Tokens, seq_len: int, num_windows: int, micro_batch_size: int,
                rank: int, world_size: int, device: torch.device | str = "cpu"
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """This rank's share of the first ``num_windows`` validation windows: ``(inputs, targets,
    padding)`` per forward.

    [Note: validation split]
        The windows (at most as many as the stream holds) are cut into ``world_size``
        contiguous slices whose sizes differ by at most one, so every window is evaluated once
        and the set is the same at any world size. Every rank runs the same number of forwards
        (collectives inside the forward, the FP8 amax reduction, must stay matched): as many as
        the largest slice needs; a rank whose slice runs out first evaluates window 0 as
        ``padding``, which the caller leaves out of the mean. So with fewer windows than ranks
        each rank still runs a forward, and the mean covers exactly the windows there are.
    """
    available = (len(tokens) - 1) // seq_len
    n = min(num_windows, available)
    if n < 1:
        raise ValueError(f"{len(tokens)} validation tokens hold no window of {seq_len + 1}")
    check_tokens(tokens)
    first, last = rank * n // world_size, (rank + 1) * n // world_size
    largest = -(-n // world_size)  # ceil(n / W)
    forwards = -(-largest // micro_batch_size)
    dev = torch.device(device)
    for k in range(forwards):
        idx = range(first + k * micro_batch_size, min(first + (k + 1) * micro_batch_size, last))
        padding = len(idx) == 0
        x, y = _to_batch([_window(tokens, j, seq_len) for j in (idx if not padding else [0])], dev)
        yield x, y, padding

"""SIGINT and SIGTERM: stop with one line, the files whole and no partial checkpoint left.

[Note: signals]
    ``python -m fp8shard.train`` installs one handler for SIGINT and SIGTERM (torchrun forwards
    either to every rank when it gets it; Ctrl-C reaches a single process directly). The first
    signal raises :class:`Interrupted` (a ``BaseException``, so no ``except Exception`` on the
    way swallows it) wherever the main thread is; a rank blocked in a collective gets there when
    its peer's exit ends that collective. On the way out ``metrics.jsonl`` is closed (its
    records are written whole, line by line, so the file ends with a complete line), rank 0
    removes what an interrupted checkpoint save or file write left (``.tmp-*`` directories,
    ``.*.tmp-<pid>`` files; complete checkpoints and ``latest`` only ever change by an atomic
    rename, so they are whole) and releases the run directory's lock; every rank prints one
    line (``fp8shard.train: stopped by SIGTERM (rank 1) at step 5 ...``) and exits with
    128 + the signal number (130, 143), no traceback. Later signals (torchrun may repeat its
    own) are recorded and ignored while the first one is being handled.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A stop signal arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_received: list[int] = []


def received() -> int | None:
    """The first stop signal received since :func:`handle_signals` was entered, if any."""
    return _received[0] if _received else None


def _handler(signum: int, frame: object) -> None:
    first = not _received
    _received.append(signum)
    if first:
        raise Interrupted(signum)


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise :class:`Interrupted` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

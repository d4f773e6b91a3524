"""The checkpoint errors: one base class, so callers can catch every checkpoint problem at once."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded; the message says what and where."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path (or no complete one under a checkpoint root)."""


class CheckpointFormatError(CheckpointError, ValueError):
    """The files are damaged (truncated, corrupted, incomplete), foreign, or of a newer format."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the model or optimizer it is loaded into."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed on some rank (disk full, permission denied, an I/O error).

    Raised on every rank; nothing was published and the complete checkpoints beside it are
    untouched ([Note: storage faults]). ``errno`` is the failing ``OSError``'s, when there was one."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


ERRORS: dict[str, type[Exception]] = {c.__name__: c for c in (
    CheckpointError, CheckpointNotFoundError, CheckpointFormatError, CheckpointMismatchError,
    CheckpointSaveError)}

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


ERRORS: dict[str, type[Exception]] = {c.__name__: c for c in (
    CheckpointError, CheckpointNotFoundError, CheckpointFormatError, CheckpointMismatchError)}

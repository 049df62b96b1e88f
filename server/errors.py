"""The session's exception hierarchy, one class per gRPC status a user can cause.

Each class also inherits the built-in a Python caller would expect (``ValueError`` for bad
input, ``RuntimeError`` for the wrong state), so the engine reads as plain Python, and the
servicer maps them to status codes in one place.
"""

from __future__ import annotations


class TrainwireError(Exception):
    """Base of every error the session raises on purpose."""


class InvalidArgument(TrainwireError, ValueError):
    """Malformed input, bad names or settings (INVALID_ARGUMENT)."""


class FailedPrecondition(TrainwireError, RuntimeError):
    """The session is in the wrong state for this call (FAILED_PRECONDITION)."""


class PositionMismatch(FailedPrecondition):
    """``expected_position`` is not where the session is; ``position`` is where it is (the
    servicer sends it in the trailing metadata too)."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


class NotFound(TrainwireError, FileNotFoundError):
    """A named checkpoint, export or model does not exist (NOT_FOUND)."""


class AlreadyExists(TrainwireError, ValueError):
    """An operation key was reused with another payload (ALREADY_EXISTS)."""


class ResourceExhausted(TrainwireError, RuntimeError):
    """Out of memory or over a size limit (RESOURCE_EXHAUSTED)."""


class Unavailable(TrainwireError, RuntimeError):
    """Restoring or shutting down; retry later (UNAVAILABLE)."""

"""The session's exception hierarchy, one class per gRPC status a user can cause.

Each class also inherits the built-in a Python caller would expect (``ValueError`` for bad
input, ``RuntimeError`` for the wrong state), so the engine reads as plain Python; ``STATUSES``
maps them to gRPC and HTTP statuses in one place, for both transports.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass


class TrainwireError(Exception):
    """Base of every error the session raises on purpose."""


class InvalidArgument(TrainwireError, ValueError):
    """Malformed input, bad names or settings (INVALID_ARGUMENT)."""


class FailedPrecondition(TrainwireError, RuntimeError):
    """The session is in the wrong state for this call (FAILED_PRECONDITION)."""


class InUse(FailedPrecondition):
    """A removal of something an open run still needs (a checkpoint its journaled operations
    read back after a restart): refused until that need ends (HTTP 409 Conflict)."""


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


class Cancelled(TrainwireError, RuntimeError):
    """The caller gave up on the request (its RPC was cancelled or its connection went away):
    the work stopped there, and nobody is left to read this answer (CANCELLED)."""


class Unauthenticated(TrainwireError, PermissionError):
    """A credential that is missing, wrong or expired (a download URL's signature, say)."""


class RequestTooLarge(InvalidArgument):
    """A request body past a transport's bound, refused before it is read (HTTP 413)."""


@dataclass(frozen=True)
class Status:
    """What a failed call is answered with on each transport: a gRPC status code's name and an
    HTTP status."""

    grpc: str
    http: int


# The one map from errors to statuses, first match wins: the project's own classes, then the
# built-ins a library may raise. The Tinker SDK retries 429 and 503 and gives up on other 4xx.
STATUSES: tuple[tuple[type[BaseException], Status], ...] = (
    (RequestTooLarge, Status("INVALID_ARGUMENT", 413)),
    (InvalidArgument, Status("INVALID_ARGUMENT", 400)),
    (InUse, Status("FAILED_PRECONDITION", 409)),
    (FailedPrecondition, Status("FAILED_PRECONDITION", 400)),
    (NotFound, Status("NOT_FOUND", 404)),
    (AlreadyExists, Status("ALREADY_EXISTS", 400)),
    (ResourceExhausted, Status("RESOURCE_EXHAUSTED", 429)),
    (Unavailable, Status("UNAVAILABLE", 503)),
    (Unauthenticated, Status("UNAUTHENTICATED", 401)),
    (Cancelled, Status("CANCELLED", 499)),  # 499: nginx's "client closed request"
    (ValueError, Status("INVALID_ARGUMENT", 400)),
    (FileNotFoundError, Status("NOT_FOUND", 404)),
    (MemoryError, Status("RESOURCE_EXHAUSTED", 429)),
)
EXHAUSTED = Status("RESOURCE_EXHAUSTED", 429)
UNEXPECTED = Status("INTERNAL", 500)


def status_of(error: BaseException) -> Status:
    """The status a failed call reports for ``error``; INTERNAL (500) for anything unexpected.

    Memory or disk running out is RESOURCE_EXHAUSTED wherever it surfaces: torch and safetensors
    raise it as a plain RuntimeError or their own error, which no class above matches.
    """
    for cls, status in STATUSES:
        if isinstance(error, cls):
            return status
    return EXHAUSTED if exhaustion_advice(error) is not None else UNEXPECTED


# -- what the machine ran out of -----------------------------------------------------------------
# torch and safetensors report these as plain RuntimeError / SafetensorError / OSError; a caller
# can act on them (smaller batches, free disk), so they are RESOURCE_EXHAUSTED, never INTERNAL.

OUT_OF_MEMORY_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",  # torch's CPU allocator, older releases
    "DefaultCPUAllocator: not enough memory",  # and newer ones
    "out of memory",  # CUDA and MPS, when not raised as torch.OutOfMemoryError
)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_MESSAGES = ("No space left on device", "StorageFull", "Disk quota exceeded")


def is_out_of_memory(error: BaseException) -> bool:
    """``MemoryError``, or an allocator's RuntimeError (torch.OutOfMemoryError is one)."""
    if isinstance(error, MemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in OUT_OF_MEMORY_MESSAGES)


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC or a quota, as an OSError or inside a library's error (safetensors wraps it)."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    return any(message in str(error) for message in DISK_FULL_MESSAGES)


def exhaustion_advice(error: BaseException) -> str | None:
    """What a caller can do about ``error`` if memory or disk ran out; None otherwise."""
    if is_out_of_memory(error):
        return (
            "the server ran out of memory: send smaller requests (fewer or shorter examples) "
            "or run the server with more memory"
        )
    if is_disk_full(error):
        return (
            "the server's disk is full: free space in its state directory (old runs, "
            "checkpoints, exports) and retry"
        )
    return None

"""Retries with exponential backoff and jitter, for calls that are safe to repeat.

Every state-changing call carries an operation key, so repeating one after a lost response is
answered from the server's journal: retrying UNAVAILABLE and DEADLINE_EXCEEDED is always safe.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from trainwire.client.session.errors import ServerUnreachable
from trainwire.contract.codec import POSITION_METADATA_KEY

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The jitter's own generator. The module-level ``random`` functions share one global state,
# which an in-process session installs and captures around each operation (its RNG is part of
# its bits): a client retrying on another thread of the same process must not draw from it.
_JITTER = random.Random()

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a call is retried.

    Attributes:
        max_attempts: tries in all, the first included (1: never retry).
        initial_backoff_s: the wait before the first retry, before jitter.
        max_backoff_s: the longest wait between two tries, before jitter.
        multiplier: each wait is this many times the previous one.
        jitter: each wait is scaled by a random factor in ``[1 - jitter, 1]``, so clients that
            failed together do not retry together.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            problems.append(f"max_attempts must be a positive integer, got {self.max_attempts!r}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            problems.append("backoffs must be >= 0")
        if self.multiplier < 1:
            problems.append(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            problems.append(f"jitter must be in [0, 1], got {self.jitter}")
        if problems:
            raise ValueError("invalid retry policy: " + "; ".join(problems))

    def delay_s(self, retry: int, rng: Callable[[], float] = _JITTER.random) -> float:
        """The wait before retry number ``retry`` (0-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retry)
        return base * (1 - self.jitter * rng())


def call_with_retry(
    call: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str = "call",
    sleep: Callable[[float], None] = time.sleep,
    rng: Callable[[], float] = _JITTER.random,
) -> T:
    """``call()``, retried on UNAVAILABLE and DEADLINE_EXCEEDED; other errors raise at once, and
    so does ``ServerUnreachable`` (no server ever answered there: waiting would not help).

    The last error is raised as received (a ``grpc.RpcError``), so ``.code()`` is the status.
    """
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return call()
        except grpc.RpcError as error:
            if not is_retryable(error) or attempt == policy.max_attempts:
                raise
            delay = policy.delay_s(attempt - 1, rng)
            # Detail: the caller decides what a user sees (the controller says once that the
            # server is unreachable; a call that still fails raises).
            logger.debug(
                "%s: %s (%s); retry %d of %d in %.2fs",
                what,
                error.code().name,
                error.details(),
                attempt,
                policy.max_attempts - 1,
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


def is_retryable(error: grpc.RpcError) -> bool:
    """A failure that a later try may not meet: UNAVAILABLE or DEADLINE_EXCEEDED from a server
    that was reached (a target where none ever answered is ``ServerUnreachable``)."""
    return error.code() in RETRYABLE_CODES and not isinstance(error, ServerUnreachable)


def position_from_error(error: grpc.RpcError) -> int | None:
    """The server's real position from a FAILED_PRECONDITION position mismatch, else None.

    The server sends it once, as the ``trainwire-position`` trailing metadata; the details text
    is for people and is never parsed. Another FAILED_PRECONDITION (no session open, another
    config) carries no position and gives None.
    """
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    trailing = getattr(error, "trailing_metadata", lambda: None)() or ()
    for key, value in trailing:
        if key == POSITION_METADATA_KEY:
            return int(value)
    return None

"""The futures the SDK polls: a request id answers at once, its result comes later.

A result enters the store only after it is durable (a keyed operation's journal commit happens
inside ``SessionHost`` before the host returns; every other result is in the front's request log
first), so a poll can never see a result that a crash could take back. A poll is held up to
``hold_s`` and then answered ``try_again``; the SDK re-polls at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
USER_ERRORS = (InvalidArgument, FailedPrecondition, NotFound, ValueError)


@dataclass(frozen=True)
class Done:
    """A finished request: a JSON object, or protobuf bytes (``ForwardBackwardOutput``,
    ``SampleResponse``)."""

    body: dict[str, Any] | bytes


@dataclass(frozen=True)
class Failed:
    """A failed request: ``category`` is ``user`` (the caller's mistake) or ``server``."""

    error: str
    category: str

    def body(self) -> dict[str, str]:
        return {"error": self.error, "category": self.category}


Outcome = Done | Failed


class FutureStore:
    """Request id → outcome, with polls that wait for it on the HTTP event loop (no thread per
    held poll; the thread that resolves wakes the waiting loop)."""

    def __init__(self) -> None:
        self._outcomes: dict[str, Outcome | None] = {}
        self._delivered: set[str] = set()  # handed to a poll (the request log may forget them)
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        """Register a pending request (a no-op for one already known: a re-sent request)."""
        with self._lock:
            self._outcomes.setdefault(request_id, None)

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._outcomes

    def pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._outcomes and self._outcomes[request_id] is None

    def delivered(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._delivered

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        with self._lock:
            self._outcomes[request_id] = outcome
            waiters = self._waiters.pop(request_id, [])
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(_wake, waiter)

    async def wait(self, request_id: str, hold_s: float) -> Outcome | None:
        """The outcome once there is one; None after ``hold_s`` (answer ``try_again``).

        Raises ``KeyError`` for a request id this server never issued.
        """
        with self._lock:
            if request_id not in self._outcomes:
                raise KeyError(request_id)
            if self._outcomes[request_id] is None:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.setdefault(request_id, []).append((waiter.get_loop(), waiter))
            else:
                waiter = None
        if waiter is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waiter, hold_s)
        with self._lock:
            waiting = self._waiters.get(request_id, [])
            if waiter is not None and (waiter.get_loop(), waiter) in waiting:
                waiting.remove((waiter.get_loop(), waiter))
            outcome = self._outcomes[request_id]
            if outcome is not None:
                self._delivered.add(request_id)
            return outcome


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def run_to_outcome(call: Callable[[], Any]) -> Outcome:
    """A call's result, or its error as the SDK's ``{"error", "category"}``."""
    try:
        return Done(call())
    except USER_ERRORS as error:
        return Failed(str(error), "user")
    except Unavailable as error:
        return Failed(str(error), "server")
    except Exception as error:
        logger.exception("a Tinker call failed")
        return Failed(f"{type(error).__name__}: {error}", "server")

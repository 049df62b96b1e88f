"""Ordered submission: keyed calls on one session, applied in the order issued, several at once.

Each call is numbered at issue time with the position it will have (``expected_position``), so
the server applies them in that order whatever order they arrive in (it holds an early one until
its predecessors ran; see ``trainwire.server.service.scheduler``) and refuses any that would
land elsewhere. Each call retries UNAVAILABLE and DEADLINE_EXCEEDED with its own key like a
blocking call, so it still applies exactly once, and the ones behind it stay in order because
their positions do.

Why positions rather than one ordered stream: every call already carries its key and position,
so ordering needs no new RPC, retries stay per call, and a server restart simply makes the held
calls meet the restored position, as a blocking call does.

``OperationPipeline`` is the one place that numbers calls, bounds them and forgets the numbering
when it no longer holds. It has two owners, each with an instance of its own:

- ``SessionClient``, for its ``*_async`` calls (bound: ``max_in_flight``). A call without a
  position takes the one after the previous call's; when that is unknown (the first call, after a
  failure, after a blocking keyed call, which moved the session outside the numbering:
  ``out_of_band``) it asks the server.
- The Controller, for one run (bound: its ``window``), running the client's blocking calls on
  the pipeline's threads. It numbers from its own record (``start_at``) and never asks the
  server: a position learned there could put a planned operation where another one belongs.
  After a failure it issues nothing ahead, and resumes only once it has resynchronized.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_WINDOW = 4
"""Operations a controller keeps in flight unless told otherwise (``Controller(window=...)``):
measured at 1.016 of in-process against 1.373 for a window of 1 (bench/controller.py; other
windows not measured), with the same bits as a window of 1."""


class OperationPipeline:
    """Calls numbered in the order issued, at most ``max_in_flight`` of them running at once.

    Args:
        max_in_flight: calls running at once; ``submit`` blocks the caller beyond that.
        current_position: where the session stands, asked when the numbering is unknown. None:
            the owner numbers (``start_at``), and nothing is numbered while it is unknown.
    """

    def __init__(
        self, max_in_flight: int, current_position: Callable[[], int] | None = None
    ) -> None:
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self._current_position = current_position
        self._pool = futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="trainwire-pipe")
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._next: int | None = None  # the position the next unnumbered call gets
        self._outstanding: set[futures.Future[Any]] = set()

    def start_at(self, position: int) -> None:
        """Number the next call ``position``: its owner knows where the session stands."""
        with self._lock:
            self._next = position

    def submit(
        self, call: Callable[[int], T], expected_position: int | None = None
    ) -> futures.Future[T]:
        """``call(position)`` on a pipeline thread, numbered ``expected_position`` or the next.

        Waits for a free slot. Raises ``RuntimeError`` when the numbering is unknown and there is
        no ``current_position`` to ask.
        """
        self._slots.acquire()
        future = self._issue(call, expected_position, ask=True)
        assert future is not None  # asking either numbers the call or raises
        return future

    def try_submit(self, call: Callable[[int], T]) -> futures.Future[T] | None:
        """``call`` numbered next if that needs no wait, neither for a slot nor for the server;
        else None and nothing issued (no free slot, or the numbering was forgotten)."""
        if not self._slots.acquire(blocking=False):
            return None
        return self._issue(call, None, ask=False)

    def _issue(
        self, call: Callable[[int], T], expected_position: int | None, *, ask: bool
    ) -> futures.Future[T] | None:
        """With a slot taken: number ``call`` and start it, or give the slot back."""
        future: futures.Future[T] = futures.Future()
        try:
            with self._lock:
                position = self._numbered(expected_position, ask=ask)
                if position is not None:
                    self._pool.submit(self._run, future, call, position)
                    self._outstanding.add(future)
                    self._next = position + 1
                    return future
        except BaseException:
            self._slots.release()
            raise
        self._slots.release()
        return None

    def _numbered(self, expected_position: int | None, *, ask: bool) -> int | None:
        if expected_position is not None:
            return expected_position
        if self._next is None and ask:
            if self._current_position is None:
                raise RuntimeError("no position to number the call with: start_at() first")
            self._next = self._current_position()
        return self._next

    def _run(self, future: futures.Future[T], call: Callable[[int], T], position: int) -> None:
        """Run ``call`` and settle the pipeline *before* its caller can see the outcome, so the
        slot is free and a failure forgotten by then."""
        if not future.set_running_or_notify_cancel():
            self._settle(future, failed=True)  # cancelled before it ran: its place is lost too
            return
        try:
            result = call(position)
        except BaseException as error:
            self._settle(future, failed=True)
            future.set_exception(error)
        else:
            self._settle(future, failed=False)
            future.set_result(result)

    def _settle(self, future: futures.Future[Any], *, failed: bool) -> None:
        with self._lock:
            self._outstanding.discard(future)
            if failed:
                # Nothing after a failure applies: the calls numbered behind it are refused.
                self._next = None
        self._slots.release()

    def out_of_band(self, call: Callable[[], T]) -> T:
        """``call()`` on this thread, after every call issued so far; it moves the session
        outside the numbering, so the numbering is forgotten afterwards."""
        self.drain()
        try:
            return call()
        finally:
            with self._lock:
                self._next = None

    def drain(self) -> None:
        """Wait until every call issued so far has finished (successfully or not)."""
        with self._lock:
            pending = list(self._outstanding)
        futures.wait(pending)

    def close(self) -> None:
        """Wait for the calls in flight, then stop the pipeline's threads."""
        self._pool.shutdown(wait=True)

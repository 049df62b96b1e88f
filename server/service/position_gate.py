"""Pipelined operations may arrive out of order; the gate puts them back in order.

A client with several operations in flight sends each with the position it will have
(``expected_position``). Requests travel on separate HTTP/2 streams and handler threads, so
position p+1 can reach the server before p. Rather than refuse it, the host holds it at the gate
until the session has reached its position, then queues it on the executor.

The hold is bounded by *idle* time: while some keyed operation is queued or running, a
predecessor is plausibly among them and the wait goes on; once nothing has run for
``idle_timeout_s`` (the predecessor was never sent, or the server restarted and restored an
older state), the operation goes ahead and the usual position check refuses it with
FAILED_PRECONDITION and the real position. When the operation at the session's position fails
(refused, nothing applied), every held one behind it is released at once to be refused the same
way: nothing after a failure runs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

DEFAULT_IDLE_TIMEOUT_S = 2.0


class PositionGate:
    """Holds operations whose expected position is ahead of the session."""

    def __init__(
        self, position: Callable[[], int], *, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    ) -> None:
        self._position = position  # where the session is now (read under no lock: an int)
        self.idle_timeout_s = idle_timeout_s
        self._changed = threading.Condition()
        self._running = 0  # keyed operations queued on the executor or running there
        self._failures = 0  # operations that failed at the session's position

    def wait_for(self, expected: int | None) -> None:
        """Return once the session is at ``expected``, a failure released the wait, or the
        executor has been idle for ``idle_timeout_s``; the position check then decides."""
        if expected is None:
            return
        with self._changed:
            failures = self._failures
            idle_since: float | None = None
            while self._position() < expected and self._failures == failures:
                now = time.monotonic()
                if self._running:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= self.idle_timeout_s:
                    return
                self._changed.wait(timeout=self.idle_timeout_s / 4)

    @contextlib.contextmanager
    def running(self, expected: int | None) -> Iterator[None]:
        """Around a keyed operation from queueing to its end: held ones keep waiting meanwhile,
        and are woken when it ends (released at once if it failed at the session's position)."""
        with self._changed:
            self._running += 1
        failed_here = False
        try:
            yield
        except BaseException:
            # Nothing was applied, so the position is where this operation expected it: it was
            # the head of the line, and nothing held behind it can run.
            failed_here = expected is not None and expected == self._position()
            raise
        finally:
            with self._changed:
                self._running -= 1
                if failed_here:
                    self._failures += 1
                self._changed.notify_all()

    def moved(self) -> None:
        """The session's position changed outside an operation (open, restore): re-check."""
        with self._changed:
            self._changed.notify_all()

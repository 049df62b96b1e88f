"""The session's executor: one thread every session call runs on, in arrival order, bounded.

One thread, so nothing interleaves inside the engine and torch always runs on the same thread.
Bounded, because every gRPC handler that waits for the session holds one of the server's
threads: past ``max_queued`` waiting calls a new one is refused (RESOURCE_EXHAUSTED) rather than
kept, so threads stay free for health checks and ``Info``, which answer at once whatever waits.
A call counts from the moment it is ``admitted`` (a keyed call held in position order for
its predecessor counts as much as one queued here) until it ends: one bound for every wait.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TypeVar

from trainwire.server.errors import ResourceExhausted, Unavailable

T = TypeVar("T")

DEFAULT_MAX_QUEUED = 24  # of the server's default 32 handler threads, 8 stay free for the rest


class SessionExecutor:
    """Runs calls one at a time; ``busy`` while any is queued or running on its thread."""

    def __init__(self, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        self.max_queued = max_queued
        self._worker = futures.ThreadPoolExecutor(1, thread_name_prefix="trainwire-session")
        self._lock = threading.Lock()
        self.waiting = 0  # admitted calls: held in position order, queued or running
        self._on_worker = 0  # queued on the worker thread or running there
        self._released = False
        # Moves with every call queued that samples may not decode beside (see ``run``).
        self.epoch = 0

    @property
    def busy(self) -> bool:
        return self._on_worker > 0

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Count the caller against the bound until the block ends; refused when ``max_queued``
        calls already wait (an operation, a read; lifecycle calls are never refused)."""
        with self._lock:
            if self._released:
                raise Unavailable("the server has stopped")
            if self.waiting >= self.max_queued:
                raise ResourceExhausted(
                    f"{self.waiting} calls are already waiting for the session (the limit is "
                    f"{self.max_queued}); wait for their results before sending more"
                )
            self.waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiting -= 1

    def run(self, call: Callable[[], T], *, joinable: bool = False) -> T:
        """``call()`` on the executor thread after everything queued before it.

        Every call but a ``joinable`` one (a batch of samples) moves ``epoch``: a sample request
        that saw an epoch may decode in any batch that started at that epoch or later, but never
        in one that runs before a call queued after it (``sample_batching``).
        """
        with self._lock:
            if self._released:
                raise Unavailable("the server has stopped")
            self._on_worker += 1
            if not joinable:
                self.epoch += 1
            try:  # queued under the lock: the queue's order is the epochs' order
                queued = self._worker.submit(call)
            except BaseException:
                self._on_worker -= 1
                raise
        try:
            return queued.result()
        finally:
            with self._lock:
                self._on_worker -= 1

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing queued before this call runs; False if ``timeout_s`` passed."""
        try:
            self._worker.submit(lambda: None).result(timeout=timeout_s)
        except futures.TimeoutError:
            return False
        return True

    def release(self, last: Callable[[], None]) -> None:
        """Run ``last`` after everything queued, then stop taking calls (once)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._worker.submit(last).result()
        self._worker.shutdown()

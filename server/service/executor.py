"""The session's executor: one thread every session call runs on, in fair turns, bounded.

One thread, so nothing interleaves inside the engine and torch always runs on the same thread.
Each call runs in a *lane* (a run's id; "" for what belongs to no run): calls of one lane run in
arrival order, and lanes with work take turns, one call each (deficit round robin, so a lane
of weight 2 runs two calls a turn, one of weight 0.5 one call every other turn). A run that
floods the executor therefore never delays another run's next call by more than one call of
each other lane with work (times its weight); with one lane, as on a server of one run, the
executor is first in, first out. The rule is ``fair_turns.FairTurns``'s, the same the stream
order takes its turns by, so a run's numbered requests reach the executor in fair turns too.

Bounded, because every gRPC handler that waits for the session holds one of the server's
threads: past ``max_queued`` waiting calls of one *account* (a tenant; "" on a server without
tenants) a new one of that account is refused (RESOURCE_EXHAUSTED) rather than kept, so threads
stay free for health checks, ``Info`` and the other tenants (the listener has threads for each
tenant's bound). A call counts from the moment it is ``admitted`` (a keyed call held in position
order for its predecessor counts as much as one queued here) until it ends. A request accepted
already (a Tinker request at its turn, bounded when its transport took it) is counted as waiting
but never refused here: a call accepted is a promise, whatever other tenants send.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

from trainwire.server.errors import ResourceExhausted, Unavailable
from trainwire.server.service.fair_turns import FairTurns

# FairTurns stays importable from here: it is the executor's queue as much as the order's.
__all__ = ["DEFAULT_MAX_QUEUED", "FairTurns", "SessionExecutor"]

T = TypeVar("T")

DEFAULT_MAX_QUEUED = 24  # of the server's default 32 handler threads, 8 stay free for the rest
# A queued call: its arrival number, the call, and the future its caller waits on.
Job = tuple[int, Callable[[], Any], "futures.Future[Any]"]


class SessionExecutor:
    """Runs calls one at a time; ``busy`` while any is queued or running on its thread.

    ``weight_of(lane)``: a lane's share of the turns (see ``FairTurns``)."""

    def __init__(
        self,
        max_queued: int = DEFAULT_MAX_QUEUED,
        weight_of: Callable[[str], float] | None = None,
    ) -> None:
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a job queued, or the queue drained
        self._turns: FairTurns[Job] = FairTurns(weight_of)
        self._barriers: deque[Job] = deque()  # run once every call queued before has run
        self._arrivals = 0  # calls and barriers queued so far (their arrival numbers)
        self.waiting = 0  # admitted calls: held in position order, queued or running
        self._waiting_of: Counter[str] = Counter()  # of them, each account's bounded ones
        self._on_worker = 0  # queued on the worker thread or running there
        self._released = False
        self._stopping = False
        # Moves with every call queued that samples may not decode beside (see ``run``).
        self.epoch = 0
        self._thread = threading.Thread(target=self._serve, name="trainwire-session", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._on_worker > 0

    @contextlib.contextmanager
    def admitted(self, account: str | None = "") -> Iterator[None]:
        """Count the caller as waiting until the block ends (an operation, a read; lifecycle
        calls are never counted). Refused when ``max_queued`` calls of ``account`` already
        wait, whatever other accounts hold; ``account`` None: a request accepted already, at
        its turn, never refused for what waits."""
        with self._lock:
            if self._released:
                raise Unavailable("the server has stopped")
            if account is not None:
                held = self._waiting_of[account]
                if held >= self.max_queued:
                    raise ResourceExhausted(
                        f"{held} calls of this key are already waiting for the session (the "
                        f"limit is {self.max_queued} per key); wait for their results before "
                        "sending more"
                    )
                self._waiting_of[account] += 1
            self.waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiting -= 1
                if account is not None:
                    self._waiting_of[account] -= 1
                    if not self._waiting_of[account]:
                        del self._waiting_of[account]

    def run(self, call: Callable[[], T], *, joinable: bool = False, lane: str = "") -> T:
        """``call()`` on the executor thread, after everything queued before it in ``lane``
        and in its turn among the other lanes.

        Every call but a ``joinable`` one (a batch of samples) moves ``epoch``: a sample request
        that saw an epoch may decode in any batch that started at that epoch or later, but never
        in one that runs before a call queued after it (``sample_batching``).
        """
        queued: futures.Future[T] = futures.Future()
        with self._lock:
            if self._released:
                raise Unavailable("the server has stopped")
            self._on_worker += 1
            if not joinable:
                self.epoch += 1
            self._turns.put(lane, (self._arrival(), call, queued))  # under the lock: in order
            self._work.notify()
        try:
            return queued.result()
        finally:
            with self._lock:
                self._on_worker -= 1

    def _arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def _serve(self) -> None:
        """The executor thread: a barrier whose predecessors all ran, else the next job in
        turn; until released and drained."""
        while True:
            with self._lock:
                job = self._next()
                while job is None:
                    if self._stopping:
                        return
                    self._work.wait()
                    job = self._next()
            _, call, result = job
            if not result.set_running_or_notify_cancel():
                continue
            try:
                result.set_result(call())
            except BaseException as error:
                result.set_exception(error)

    def _next(self) -> Job | None:
        oldest = min((arrival for arrival, _, _ in self._turns.heads()), default=None)
        if self._barriers and (oldest is None or oldest > self._barriers[0][0]):
            return self._barriers.popleft()
        return self._turns.take()

    def _after_all(self, last: Callable[[], T]) -> futures.Future[T]:
        """``last`` on the executor thread once every call queued before it has run, in any
        lane (calls queued after it may run first)."""
        done: futures.Future[T] = futures.Future()
        with self._lock:
            self._barriers.append((self._arrival(), last, done))
            self._work.notify()
        return done

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing queued before this call runs; False if ``timeout_s`` passed."""
        try:
            self._after_all(lambda: None).result(timeout=timeout_s)
        except futures.TimeoutError:
            return False
        return True

    def release(self, last: Callable[[], None]) -> None:
        """Run ``last`` after everything queued, then stop taking calls (once)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._after_all(last).result()
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        self._thread.join()

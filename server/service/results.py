"""The results a client fetches by ticket: a request id answers at once, its result comes later.

A result enters the store only after it is durable (a keyed operation's journal commit happens
inside ``SessionHost`` before the host returns; every other result is in the intake's request
log first), so a fetch can never see a result that a crash could take back. A fetch is held up to
``hold_s`` and then answered "not yet" (None); the Tinker SDK re-polls at once.

Each request keeps the digest of its payload (a re-send must carry the same one) and when its
result was resolved and first handed out (wall-clock seconds, so they outlive a restart). A result
handed out is not a result received: the response may be lost and the client asks again, perhaps
after a restart. So once a request's own record leaves the request store (compaction), its result is
carried in the log while ``retained`` keeps it:

- a result handed out (or a refusal answered at once): for ``KEEP_DELIVERED``, one hour after it
  was last handed out, the newest 4,096 and 64 MiB of them at most;
- a result never fetched yet: for ``KEEP_UNDELIVERED``, a day after it was resolved, the newest
  4,096 and 256 MiB of them at most (a live client fetches each of its tickets at once: what waits
  that long belongs to a client that is gone).

A lost response is asked again within the client's retries, while at most as many fetches are in
flight as the client has connections, well under those bounds. The requests of a client session
the intake forgot leave the store with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from trainwire.server.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)

logger = logging.getLogger(__name__)

USER_ERRORS = (InvalidArgument, FailedPrecondition, NotFound, ValueError)


@dataclass(frozen=True)
class Done:
    """A finished request: its encoded response, a JSON object or bytes (the Tinker front's
    protobuf ``ForwardBackwardOutput`` and ``SampleResponse``), or one ``Deferred`` until it is
    asked for."""

    body: dict[str, Any] | bytes | Deferred


@dataclass(frozen=True)
class Failed:
    """A failed request: ``category`` is ``user`` (the caller's mistake) or ``server``."""

    error: str
    category: str

    def body(self) -> dict[str, str]:
        return {"error": self.error, "category": self.category}


Outcome = Done | Failed


class Deferred:
    """A response encoded when it is first asked for, once (every later fetch gets the same
    bytes). A keyed call's response is deferred: its journal entry is its durable record, so
    encoding it need not hold the engine thread; the fetch encodes it on the front's worker
    thread (``settled``), and a compaction that carries it before anyone fetched it, there."""

    def __init__(self, encode: Callable[[], dict[str, Any] | bytes]) -> None:
        self._encode: Callable[[], dict[str, Any] | bytes] | None = encode
        self._lock = threading.Lock()
        self._outcome: Outcome | None = None

    def outcome(self) -> Outcome:
        """The encoded response, or why encoding it failed (a ``server`` failure)."""
        with self._lock:
            if self._outcome is None:
                assert self._encode is not None
                self._outcome, self._encode = run_to_outcome(self._encode), None
            return self._outcome


def settled(outcome: Outcome) -> Outcome:
    """``outcome`` with its response encoded: a ``Deferred`` one's now, on the caller's thread."""
    if isinstance(outcome, Done) and isinstance(outcome.body, Deferred):
        return outcome.body.outcome()
    return outcome


@dataclass(frozen=True)
class Retention:
    """How long a result stays answerable once its request's record is compacted away: at most
    ``seconds`` (from when it was handed out, or resolved if never), among the newest ``count``
    and ``size`` bytes of its kind."""

    seconds: float
    count: int
    size: int


KEEP_DELIVERED = Retention(3600.0, 4096, 64 * 1024 * 1024)
KEEP_UNDELIVERED = Retention(24 * 3600.0, 4096, 256 * 1024 * 1024)


@dataclass(frozen=True)
class Resolved:
    """A resolved request as the request store carries it: its outcome, its payload's digest,
    when it was resolved and when first handed out (None: never)."""

    request_id: str
    outcome: Outcome
    digest: str | None = None
    resolved_at: float | None = None
    delivered_at: float | None = None


@dataclass
class _Entry:
    outcome: Outcome | None = None
    digest: str | None = None
    resolved_at: float | None = None
    delivered_at: float | None = None


def outcome_size(outcome: Outcome) -> int:
    """Bytes a result takes in the request store, about."""
    if isinstance(outcome, Failed):
        return len(outcome.error)
    body = outcome.body
    return len(body) if isinstance(body, bytes) else len(json.dumps(body))


def retained(results: list[Resolved], now: float) -> list[Resolved]:
    """The ``results`` whose retention (``KEEP_DELIVERED``, ``KEEP_UNDELIVERED``) keeps them."""
    kept: list[Resolved] = []
    for delivered, bound in ((True, KEEP_DELIVERED), (False, KEEP_UNDELIVERED)):
        group = [r for r in results if (r.delivered_at is not None) == delivered]
        group.sort(key=lambda r: r.delivered_at or r.resolved_at or now, reverse=True)
        size = 0
        for result in group[: bound.count]:
            size += outcome_size(result.outcome)
            if now - (result.delivered_at or result.resolved_at or now) > bound.seconds:
                break
            if size > bound.size:
                break
            kept.append(result)
    return kept


class ResultStore:
    """Request id → outcome, with fetches that wait for it on the caller's event loop (no thread
    per held fetch; the thread that resolves wakes the waiting loop)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._entries: dict[str, _Entry] = {}
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, request_id: str, digest: str | None = None) -> None:
        """Register a pending request (a no-op for one already known: a re-sent request)."""
        with self._lock:
            self._entries.setdefault(request_id, _Entry(digest=digest))

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._entries

    def resent(self, request_id: str, digest: str) -> bool:
        """Whether a request is a re-send of one this store knows (True), or new (False).

        Raises ``AlreadyExists`` when the known one carried another payload.
        """
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None:
            return False
        if entry.digest is not None and entry.digest != digest:
            raise AlreadyExists(
                f"request {request_id!r} was already sent with another payload; a new call "
                "needs a new seq_id"
            )
        return True

    def pending(self, request_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(request_id)
            return entry is not None and entry.outcome is None

    def delivered(self, request_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(request_id)
            return entry is not None and entry.delivered_at is not None

    def mark_delivered(self, request_id: str) -> None:
        """The caller has its answer already (a refusal went back as a 400)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.delivered_at is None:
                entry.delivered_at = self._clock()

    def resolve(self, request_id: str, outcome: Outcome, at: float | None = None) -> None:
        """A request's outcome; nothing for one forgotten meanwhile (its session ended: no
        client asks for it)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return
            entry.outcome, entry.resolved_at = outcome, at or self._clock()
            waiters = self._waiters.pop(request_id, [])
        _wake_all(waiters)

    def restore(self, result: Resolved) -> None:
        """A result carried by the request store (its request's record compacted away)."""
        with self._lock:
            self._entries[result.request_id] = _Entry(
                result.outcome, result.digest, result.resolved_at, result.delivered_at
            )

    def retained(self, request_ids: Iterable[str]) -> dict[str, Resolved]:
        """Of ``request_ids``, the resolved ones whose result retention still keeps."""
        with self._lock:
            entries = [(r, self._entries.get(r)) for r in dict.fromkeys(request_ids)]
            results = [
                Resolved(r, e.outcome, e.digest, e.resolved_at, e.delivered_at)
                for r, e in entries
                if e is not None and e.outcome is not None
            ]
        results = [dataclasses.replace(r, outcome=settled(r.outcome)) for r in results]
        return {r.request_id: r for r in retained(results, self._clock())}

    def pending_among(self, chosen: Callable[[str], bool]) -> list[str]:
        """The requests not answered yet whose id ``chosen`` picks (a checkpoint's readers)."""
        with self._lock:
            return [
                request_id
                for request_id, entry in self._entries.items()
                if entry.outcome is None and chosen(request_id)
            ]

    def unfetched_owners(self, owner_of: Callable[[str], str]) -> set[str]:
        """The owners (``owner_of(request_id)``) of the requests a client may still fetch: pending
        ones, and results never handed out that ``KEEP_UNDELIVERED`` still keeps in time."""
        with self._lock:
            now = self._clock()
            return {
                owner_of(request_id)
                for request_id, entry in self._entries.items()
                if entry.outcome is None
                or (
                    entry.delivered_at is None
                    and now - (entry.resolved_at or now) <= KEEP_UNDELIVERED.seconds
                )
            }

    def forget(self, gone: Callable[[str], bool]) -> int:
        """Drop every request whose id ``gone`` names (its client is gone); a fetch held on one
        is woken and answered as for an unknown request. How many were dropped."""
        with self._lock:
            dropped = [request_id for request_id in self._entries if gone(request_id)]
            waiters = []
            for request_id in dropped:
                del self._entries[request_id]
                waiters.extend(self._waiters.pop(request_id, []))
        _wake_all(waiters)
        return len(dropped)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _forget_waiter(self, request_id: str, waiter: asyncio.Future) -> None:
        with self._lock:
            waiting = self._waiters.get(request_id, [])
            if (waiter.get_loop(), waiter) in waiting:
                waiting.remove((waiter.get_loop(), waiter))
            if not waiting:
                self._waiters.pop(request_id, None)

    async def wait(
        self, request_id: str, hold_s: float, *, hand_out: bool = True
    ) -> Outcome | None:
        """The outcome once there is one; None after ``hold_s`` (answer ``try_again``).
        ``hand_out``: the outcome is handed out now (its retention counts from now); False
        for a watcher that only learns it is there (a poller of completions).

        Raises ``KeyError`` for a request id this server never issued.
        """
        with self._lock:
            if request_id not in self._entries:
                raise KeyError(request_id)
            if self._entries[request_id].outcome is None:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.setdefault(request_id, []).append((waiter.get_loop(), waiter))
            else:
                waiter = None
        if waiter is not None:
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(waiter, hold_s)
            finally:  # cancelled too (its client went away): no waiter outlives its fetch
                self._forget_waiter(request_id, waiter)
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:  # forgotten while the fetch was held
                raise KeyError(request_id)
            if hand_out and entry.outcome is not None:  # kept from the last hand-out: it may
                entry.delivered_at = self._clock()  # be lost again
            return entry.outcome


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _wake_all(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    """Wake each waiter on its own event loop. A loop closed meanwhile (its listener stopped)
    has no fetch left to wake: the resolve that called this, on a commit's thread, must go on
    (its caller counts the results still finishing, and a server stopping waits for them)."""
    for loop, waiter in waiters:
        with contextlib.suppress(RuntimeError):  # "Event loop is closed"
            loop.call_soon_threadsafe(_wake, waiter)


def run_to_outcome(call: Callable[[], Any]) -> Outcome:
    """A call's result, or its error as ``Failed`` (the Tinker SDK's ``{"error", "category"}``)."""
    try:
        return Done(call())
    except USER_ERRORS as error:
        return Failed(str(error), "user")
    except Unavailable as error:
        return Failed(str(error), "server")
    except Exception as error:
        logger.exception("a submitted call failed")
        return Failed(f"{type(error).__name__}: {error}", "server")

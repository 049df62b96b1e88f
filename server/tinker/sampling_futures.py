"""A sampling session's completion queue (``retrieve_futures``) and its clients
(``join_sampling_session``), over the same results ``retrieve_future`` answers.

The SDK's sampling poller asks, per sampling client (a sampling session and its clone id), which
of its requests finished since its cursor; it then fetches each result with ``retrieve_future``
as before and reports the ones it has (``retrieved_request_ids``). A request's id is
``<sampling session>/<seq_id>``, and a clone's seq_ids are ``clone * CLONE_BLOCK + n``, so the
queue of a target is the requests of that session in that block. The results store keeps no
queue of its own: each poll finds the target's requests among those a client may still fetch
(``ResultStore.unfetched_owners``), reports the finished ones it has not reported yet, and
otherwise holds the poll until one of them finishes (at most ``hold_s``).

A cursor is a time in microseconds, each new event's above the last: a client that polls a
restarted server with a cursor of the process before still sees every completion after it. An
event is kept until a poll's ``prev_cursor`` covers it (a lost answer is answered again), and a
request once reported is not reported again while the client has not fetched it. What is
retained of a result is the results store's, exactly as for ``retrieve_future``: acknowledging a
request deletes nothing early. A poll names at most ``MAX_RETRIEVED_IDS`` retrieved requests and
is answered at most ``MAX_COMPLETIONS`` completions (the rest come with the next poll).

Tenancy is the sampling session's: another tenant's answers 404, as a session that is not there.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from trainwire.server.errors import InvalidArgument
from trainwire.server.service.results import Done, Failed, Outcome, outcome_size
from trainwire.server.tinker.fields import is_non_negative_int
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.tenancy import unrestricted

API = "/api/v1"
CLONE_BLOCK = 1_000_000_000  # the SDK's seq_ids of one sampling client: clone * block + n
MAX_RETRIEVED_IDS = 4096  # acknowledged requests one poll may name
MAX_COMPLETIONS = 1024  # completions one answer carries
WATCH_AT_ONCE = 256  # pending requests a held poll waits on at once (the oldest)
RESCAN_S = 1.0  # how often a held poll looks again when it watches only some of them

Target = tuple[str, int]  # a sampling session and a clone id
BodyReader = Callable[[Request], Awaitable[dict[str, Any]]]


@dataclass
class CompletionQueue:
    """One target's completions not yet covered by a poll's cursor, and what was reported."""

    events: list[tuple[int, str, Outcome]] = field(default_factory=list)  # (cursor, id, outcome)
    reported: set[str] = field(default_factory=set)
    last_cursor: int = 0

    def add(self, request_id: str, outcome: Outcome, now_us: int) -> None:
        if request_id in self.reported:
            return
        self.last_cursor = max(self.last_cursor + 1, now_us)
        self.events.append((self.last_cursor, request_id, outcome))
        self.reported.add(request_id)

    def completions_after(self, cursor: int) -> list[tuple[int, str, Outcome]]:
        """The completions past ``cursor``, dropping the ones it covers."""
        self.events = [event for event in self.events if event[0] > cursor]
        return self.events[:MAX_COMPLETIONS]


def check_target(body: dict[str, Any]) -> tuple[Target, int, float | None, list[str]]:
    """A ``FuturesRetrieveRequest``: its target, cursor, hold and acknowledged requests."""
    target = body.get("target")
    if not isinstance(target, dict) or target.get("type", "sampling_session") != "sampling_session":
        raise InvalidArgument(
            "retrieve_futures: target must be {type: sampling_session, sampling_session_id, "
            "cloned_sampler_id}"
        )
    sampling_id, clone = target.get("sampling_session_id"), target.get("cloned_sampler_id", 0)
    cursor, hold = body.get("prev_cursor", 0), body.get("timeout")
    retrieved = body.get("retrieved_request_ids") or []
    if not isinstance(sampling_id, str) or not sampling_id:
        raise InvalidArgument("retrieve_futures: target.sampling_session_id is required")
    if not is_non_negative_int(clone) or not is_non_negative_int(cursor):
        raise InvalidArgument("retrieve_futures: cloned_sampler_id and prev_cursor are ints >= 0")
    if hold is not None and (isinstance(hold, bool) or not isinstance(hold, int | float)):
        raise InvalidArgument(f"retrieve_futures: timeout must be seconds or null, got {hold!r}")
    if not isinstance(retrieved, list) or not all(isinstance(r, str) for r in retrieved):
        raise InvalidArgument("retrieve_futures: retrieved_request_ids is a list of request ids")
    if len(retrieved) > MAX_RETRIEVED_IDS:
        raise InvalidArgument(
            f"retrieve_futures: {len(retrieved)} retrieved_request_ids in one poll; at most "
            f"{MAX_RETRIEVED_IDS}: report the rest with the next poll"
        )
    return (sampling_id, clone), cursor, hold, retrieved


def in_target(request_id: str, target: Target) -> bool:
    """Whether ``request_id`` is one of ``target``'s sampling client's requests."""
    stream, _, seq = request_id.rpartition("/")
    return stream == target[0] and seq.isdigit() and int(seq) // CLONE_BLOCK == target[1]


def completion(request_id: str, outcome: Outcome) -> dict[str, Any]:
    """The SDK's ``FutureCompletion``."""
    if isinstance(outcome, Failed):
        return {"state": "failed", "request_id": request_id}
    size = outcome_size(outcome)
    return {
        "state": "finished",
        "request_id": request_id,
        "response_payload_uncompressed_size": size,
    }


class SamplingFutures:
    """The completion queues of the front's sampling clients, and the clone ids handed out."""

    def __init__(
        self, front: TinkerFront, hold_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.front = front
        self.hold_s = hold_s
        self.clock = clock
        self._lock = threading.Lock()
        self._queues: dict[Target, CompletionQueue] = {}
        self._clones: dict[str, set[int]] = {}  # sampling session → clone ids handed out

    # -- join_sampling_session -------------------------------------------------------------------

    def join(self, body: dict[str, Any]) -> dict[str, Any]:
        """A clone id for a new client of an existing sampling session: never 0 (the original
        client's), never one handed out before in this process, never one whose first request
        the server knows (a clone of the process before a restart). Drawn at random, as the SDK
        draws its own without the server: unique also against a clone that joined before a
        restart and has sent nothing yet, but for a one-in-a-billion chance."""
        sampling_id = body.get("sampling_session_id")
        if not isinstance(sampling_id, str) or not sampling_id:
            raise InvalidArgument("join_sampling_session: sampling_session_id is required")
        replaying = self.front.intake.replay_pending()  # not there, or another tenant's: 404
        self.front.sampling_sessions.require(sampling_id, replaying=replaying)
        results = self.front.intake.results
        with self._lock:
            handed_out = self._clones.setdefault(sampling_id, set())
            while True:
                clone = secrets.randbelow(CLONE_BLOCK - 1) + 1
                if clone not in handed_out and not results.known(
                    f"{sampling_id}/{clone * CLONE_BLOCK}"
                ):
                    break
            handed_out.add(clone)
        return {"type": "join_sampling_session", "client_counter": clone}

    # -- retrieve_futures ------------------------------------------------------------------------

    async def poll(self, body: dict[str, Any]) -> dict[str, Any]:
        target, cursor, hold, retrieved = check_target(body)
        replaying = self.front.intake.replay_pending()  # not there, or another tenant's: 404
        self.front.sampling_sessions.require(target[0], replaying=replaying)
        queue = self._queue(target)
        with self._lock:
            queue.reported.difference_update(retrieved)
        hold_s = self.hold_s if hold is None else min(max(float(hold), 0.0), self.hold_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        while True:
            pending = await run_in_threadpool(self._report_finished, target, queue)
            with self._lock:
                events = queue.completions_after(cursor)
            remaining = deadline - loop.time()
            if events or remaining <= 0:
                break
            watched = pending[:WATCH_AT_ONCE]
            wait_s = remaining if watched and len(watched) == len(pending) else RESCAN_S
            finished = await self._first_finished(watched, min(remaining, wait_s))
            with self._lock:
                for request_id, outcome in finished:
                    queue.add(request_id, outcome, self._now_us())
        answers = [completion(request_id, outcome) for _, request_id, outcome in events]
        return {"completions": answers, "cursor": events[-1][0] if events else cursor}

    def _queue(self, target: Target) -> CompletionQueue:
        with self._lock:
            self._forget_ended()
            return self._queues.setdefault(target, CompletionQueue())

    def _forget_ended(self) -> None:
        """Drop the queues and clone ids of sampling sessions that ended (with their model or
        their SDK session); the caller holds the lock."""
        sessions = self.front.sampling_sessions
        with unrestricted():
            ended = {s for s, _ in self._queues} | set(self._clones)
            ended = {s for s in ended if not _sampling_session_exists(sessions, s)}
        self._queues = {t: q for t, q in self._queues.items() if t[0] not in ended}
        self._clones = {s: c for s, c in self._clones.items() if s not in ended}

    def _report_finished(self, target: Target, queue: CompletionQueue) -> list[str]:
        """Report ``target``'s finished requests not reported yet; its pending ones, oldest
        first."""
        results = self.front.intake.results
        mine = sorted(
            (
                r
                for r in results.unfetched_owners(lambda request_id: request_id)
                if in_target(r, target)
            ),
            key=lambda r: int(r.rpartition("/")[2]),
        )
        pending = [r for r in mine if results.pending(r)]
        finished = results.retained(r for r in mine if r not in pending)
        with self._lock:
            queue.reported.intersection_update(finished)  # a fetched one is never asked again
            for request_id in mine:
                if request_id in finished:
                    queue.add(request_id, finished[request_id].outcome, self._now_us())
        return pending

    async def _first_finished(
        self, request_ids: list[str], wait_s: float
    ) -> list[tuple[str, Outcome]]:
        """Wait up to ``wait_s`` for any of ``request_ids`` to finish; those that did."""
        if not request_ids:
            await asyncio.sleep(wait_s)
            return []
        results = self.front.intake.results
        waits = {  # only watched: each is handed out when the client fetches it
            asyncio.ensure_future(results.wait(r, wait_s, hand_out=False)): r for r in request_ids
        }
        done, running = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in running:
            task.cancel()
        finished = []
        for task in done:
            with contextlib.suppress(KeyError):  # forgotten meanwhile: its session ended
                outcome = task.result()
                if isinstance(outcome, Done | Failed):
                    finished.append((waits[task], outcome))
        return finished

    def _now_us(self) -> int:
        return int(self.clock() * 1_000_000)


def _sampling_session_exists(sessions: Any, sampling_id: str) -> bool:
    try:
        sessions.get(sampling_id)
    except FileNotFoundError:  # NotFound
        return False
    return True


def register(app: FastAPI, front: TinkerFront, body: BodyReader, *, hold_s: float) -> None:
    """``retrieve_futures`` and ``join_sampling_session``; ``body`` reads a route's JSON body
    (the app's reader)."""
    futures = SamplingFutures(front, hold_s)

    @app.post(f"{API}/retrieve_futures")
    async def retrieve_futures(request: Request) -> dict[str, Any]:
        return await futures.poll(await body(request))

    @app.post(f"{API}/join_sampling_session")
    async def join_sampling_session(request: Request) -> dict[str, Any]:
        return futures.join(await body(request))

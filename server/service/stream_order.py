"""Per-stream ordering: each request of a stream carries its number (``seq``), and runs only after
every lower number of its stream has run. A Tinker model is a stream: the SDK numbers a training
client's calls with ``seq_id`` from 1 and may send them out of order (a big batch's chunks go in
parallel, the first one last).

What is taken and has not run yet is bounded, per stream (and for the unordered requests, the
samples, per *account*) in requests waiting and in bytes, and in bytes over all of an account's
together. An account is a tenant (each stream and each sample names its own; "" for a server
without tenants): one tenant's flood of samples or requests fills its own bounds only, and
another's requests are taken as if it were alone. The bytes are
what a request holds in memory once decoded (its transport estimates them before it is taken: a
decoded id or float is an object, several times its bytes on the wire), counted from the moment
the request is taken until its job has run, so the one running now counts too. Past a bound a
request is refused with ``ResourceExhausted`` (429 / RESOURCE_EXHAUSTED: clients retry it) before
it is recorded, except one that nothing taken is waiting before (it runs next: refusing it would
only stall), and the one request the stream's held ones are waiting for (nothing of the stream
could run without it).

A run's positions are a stream too (``start_positions``): a gRPC caller numbers each state-changing
request with the position it expects the run at (``expected_position``), and pipelined requests
may arrive out of order on separate HTTP/2 streams. One of them waits until the requests before
it were released, or the run is at its position already (a retried key is then answered from the
journal, a stale position refused by the position check); its predecessor may never come (never
sent, or the server restarted and restored an older state), so once nothing has run for the
stream's ``idle_release_s`` the first one held goes ahead and the position check refuses it with
the real position. A request held counts as activity when it arrives: after a quiet spell (a run
opening, a client evaluating) a pipelined call that overtook its predecessor by a moment waits
for it, instead of being let go at once because nothing had run for a while before it came. A
refused request does not move the position, so the ones released behind it are refused the same
way: nothing after a failure runs.

Released jobs run in fair turns by *lane* (a run's id on a server of many runs, "" on a server
of one), with the executor's rule (``fair_turns.FairTurns``, weighted by ``weight_of``): within a
lane in the order they were released, ordered and unordered alike, and lanes with released jobs
take turns. This order runs one ordered job at a time and waits until the executor has run it, so
the executor never sees more than one of them: were the released jobs first in, first out here,
a run with two hundred pipelined calls released would delay another run's next call by two
hundred operations, whatever the executor's turns. With one lane nothing is reordered.

Unordered jobs at the head of the lane whose turn it is run beside each other, as that one turn
(up to ``SAMPLES_BESIDE`` at once), so the host decodes samples as one batch
(``sample_batching``); the next ordered job runs once every unordered job started before it has
ended, as when they ran one at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from trainwire.server.errors import AlreadyExists, FailedPrecondition, ResourceExhausted
from trainwire.server.service.fair_turns import FairTurns

logger = logging.getLogger(__name__)

DEFAULT_MAX_HELD = 1024  # requests waiting to run, per stream and account's samples; more refused
# Bytes of decoded requests taken and not yet run, per stream and unordered. A maximal
# forward_backward holds about 240 MiB decoded (1,048,576 positions x 6 per-token values x 40
# bytes, ``codec.held_bytes``); the SDK sends a batch as chunks of 5 MB of wire, at most 50 MB in
# flight, about 600 MiB once decoded. 1 GiB takes the SDK's whole window, or four maximal calls,
# behind the one running: a pipelining loop is not refused, and 30 maximal calls (7 GiB) are.
DEFAULT_MAX_HELD_BYTES = 1024 * 1024 * 1024
# The same over every stream and the samples of one account together: one stream's bound and half
# of it again for the samples beside it, so what one tenant's requests hold stays a small part of
# a training host's memory.
DEFAULT_MAX_TOTAL_BYTES = 1536 * 1024 * 1024

Job = Callable[[], None]
# Samples running at once, each a call waiting on the executor (for its batch: sample_batching).
SAMPLES_BESIDE = 16


def digest(value: Any) -> str:
    """What a request's number is bound to: a re-send must carry the same payload."""
    return payload(value)[0]


def payload(value: Any) -> tuple[str, int]:
    """A request body's digest and its size in bytes (JSON as it is hashed)."""
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest(), len(data)


@dataclass(frozen=True)
class _Positions:
    """A stream numbered by a run's position: where the run is now, and how long nothing may
    have run before the first held request goes ahead anyway."""

    position: Callable[[], int]
    idle_release_s: float


@dataclass(frozen=True)
class Samples:
    """What one account's jobs outside any stream's order (its samples) wait under."""

    account: str


Key = str | Samples  # a stream, or an account's samples


@dataclass(frozen=True)
class _Released:
    """A released job: its stream (or its account's ``Samples``), the bytes it holds, the job,
    and the account those bytes count against."""

    key: Key
    size: int
    job: Job
    account: str


@dataclass
class _Waiting:
    """The jobs of one stream (or one account's samples): ``calls`` not yet running, ``ready``
    of them released, and the ``size`` in bytes of every one taken whose job has not ended."""

    calls: int = 0
    size: int = 0
    ready: int = 0


class StreamOrder:
    """Releases each stream's jobs to ``run`` in ``seq`` order, one at a time, lanes in turn.

    ``run`` is called on a thread of this object's own, never on the caller's, so an HTTP handler
    returns its request id at once; a caller that needs the answer waits for its job to tell it.
    """

    def __init__(
        self,
        run: Callable[[Job], None],
        *,
        max_held: int | None = None,
        max_bytes: int | None = None,
        max_total_bytes: int | None = None,
        noun: str = "stream",
        weight_of: Callable[[str], float] | None = None,
    ) -> None:
        """``max_held`` requests and ``max_bytes`` bytes per stream (and per account's samples),
        and ``max_total_bytes`` over all of one account's, may be held (None: the defaults).
        ``noun`` names a stream
        in refusals (a Tinker stream is a ``model``). ``weight_of(lane)``: a lane's share of the
        turns (the executor's, see ``FairTurns``)."""
        self._run = run
        self._noun = noun
        self._max_held = DEFAULT_MAX_HELD if max_held is None else max_held
        self._max_bytes = DEFAULT_MAX_HELD_BYTES if max_bytes is None else max_bytes
        self._max_total = DEFAULT_MAX_TOTAL_BYTES if max_total_bytes is None else max_total_bytes
        self._lock = threading.Condition()
        self._next: dict[str, int] = {}
        self._held: dict[str, dict[int, list[tuple[int, Job]]]] = {}  # seq → [(size, job)]
        self._positions: dict[str, _Positions] = {}  # the streams numbered by a run's position
        self._nouns: dict[str, str] = {}  # what a stream is called in refusals, when not noun
        self._lanes: dict[str, str] = {}  # the lane of each stream whose is not ""
        self._accounts: dict[str, str] = {}  # the account of each stream whose is not ""
        self._beside = 0  # calls moving a run outside this order now (``running_beside``)
        self._closing = False  # the server is shutting down: nothing is held for a position
        self._active_at = time.monotonic()  # when a job last started or ended
        self._seen: dict[tuple[str, int], str] = {}  # (stream, seq) → payload digest
        self._waiting: defaultdict[Key, _Waiting] = defaultdict(_Waiting)
        # Bytes of every job taken and not ended, by account (its streams and samples together).
        self._totals: defaultdict[str, int] = defaultdict(int)
        self._ready: FairTurns[_Released] = FairTurns(weight_of)
        self._stopped = False
        self._samples = _Beside(run, SAMPLES_BESIDE)
        self._thread = threading.Thread(target=self._loop, name="stream-order", daemon=True)
        self._thread.start()

    def start_stream(
        self,
        stream: str,
        next_seq: int = 1,
        *,
        noun: str | None = None,
        lane: str = "",
        account: str = "",
    ) -> None:
        """A stream whose requests are numbered from ``next_seq`` by their client (a Tinker
        model's ``seq_id``); ``noun`` names it in refusals (the order's own by default); its
        released jobs take ``lane``'s turns; its bytes count against ``account``'s."""
        with self._lock:
            self._next[stream] = max(self._next.get(stream, next_seq), next_seq)
            self._held.setdefault(stream, {})
            self._set_lane(stream, lane)
            if account:
                self._accounts[stream] = account
            if noun is not None:
                self._nouns[stream] = noun

    def start_positions(
        self, stream: str, position: Callable[[], int], *, idle_release_s: float, lane: str = ""
    ) -> None:
        """A stream numbered by a run's position (see the module docstring): ``position()`` is
        where the run is now; its released jobs take ``lane``'s turns. Starting it again (the
        run reopened or restored elsewhere) takes the new position."""
        with self._lock:
            self._positions[stream] = _Positions(position, idle_release_s)
            self._set_lane(stream, lane)
            self._nouns[stream] = "run"
            self._next[stream] = position()
            self._held.setdefault(stream, {})
            self._release(stream)

    @contextlib.contextmanager
    def running_beside(self, stream: str) -> Iterator[None]:
        """Around a call that moves ``stream``'s run outside this order (a keyed call without a
        position): requests held for a position wait while it runs, as while a job of the order
        runs, and look at the position again when it ends."""
        with self._lock:
            self._beside += 1
        try:
            yield
        finally:
            with self._lock:
                self._beside -= 1
                self._active_at = time.monotonic()
                if stream in self._positions:
                    self._release(stream)

    def submit_at(self, stream: str, position: int, job: Job) -> None:
        """Queue ``job``, which expects the run of ``stream`` at ``position``, in position order
        (see the module docstring); ``FailedPrecondition`` for a stream not started,
        ``ResourceExhausted`` when its requests are at their bound."""
        with self._lock:
            if stream not in self._positions:
                raise FailedPrecondition(f"run {stream!r} is not open on this server")
            self._check_room(stream, 0, needed=position <= self._floor(stream))
            self._take(stream, 0)
            if self._closing:  # refused at its turn: no predecessor will run
                self._queue(stream, 0, job)
                self._lock.notify_all()
                return
            self._held[stream].setdefault(position, []).append((0, job))
            self._active_at = time.monotonic()  # its predecessor may be a moment behind it
            self._release(stream)

    def started(self, stream: str) -> bool:
        with self._lock:
            return stream in self._next

    def end_stream(self, stream: str) -> None:
        """The stream ended (its model closed): its held jobs are released to run (and fail, as
        their transport decides), and no request of it is taken any more."""
        with self._lock:
            held = self._held.pop(stream, {})
            for seq in sorted(held):
                for size, job in held[seq]:
                    self._queue(stream, size, job)
            self._next.pop(stream, None)
            self._positions.pop(stream, None)
            self._lanes.pop(stream, None)
            self._accounts.pop(stream, None)
            self._seen = {key: value for key, value in self._seen.items() if key[0] != stream}
            self._lock.notify_all()

    def accepts(
        self, stream: str, seq: int, digest: str, size: int = 0, *, bounded: bool = True
    ) -> bool:
        """Whether ``submit`` would queue this request: False for a re-send (the same ``seq``
        with the same payload, whose ticket already exists).

        Raises ``AlreadyExists`` for the same ``seq`` with another payload,
        ``FailedPrecondition`` for a stream not started, ``ResourceExhausted`` (when
        ``bounded``) when the stream's requests or bytes, or the bytes of all its account's, are
        at their bound.
        """
        with self._lock:
            if stream not in self._next:
                noun = self._nouns.get(stream, self._noun)  # kept past the stream's end
                raise FailedPrecondition(f"{noun} {stream!r} is not open on this server")
            seen = self._seen.get((stream, seq))
            if seen is not None:
                if seen != digest:
                    raise AlreadyExists(
                        f"seq_id {seq} of {self._noun} {stream!r} was already sent with another "
                        "payload; a new call needs a new seq_id"
                    )
                return False
            expected = self._next[stream]
            if seq < expected:
                raise AlreadyExists(
                    f"seq_id {seq} of {self._noun} {stream!r} is before the next expected "
                    f"({expected}) and was never sent to this server"
                )
            if bounded:
                self._check_room(stream, size, needed=seq == expected)
            return True

    def submit(
        self,
        stream: str,
        seq: int,
        digest: str,
        job: Job,
        *,
        size: int = 0,
        bounded: bool = True,
    ) -> bool:
        """Queue ``job`` as ``seq`` of ``stream``, holding ``size`` bytes until it has run
        (see ``accepts``; False for a re-send)."""
        with self._lock:
            if not self.accepts(stream, seq, digest, size, bounded=bounded):
                return False
            self._seen[(stream, seq)] = digest
            self._held[stream][seq] = [(size, job)]
            self._take(stream, size)
            self._release(stream)
            return True

    def check_room(self, size: int = 0, *, account: str = "") -> None:
        """ResourceExhausted when ``account``'s jobs outside any order (its samples) are at
        their bound, in calls or bytes, or the bytes of all of ``account``'s are; what other
        accounts hold does not count."""
        with self._lock:
            self._check_room(Samples(account), size, needed=False)

    def run_unordered(self, job: Job, size: int = 0, *, lane: str = "", account: str = "") -> None:
        """Queue a job outside any stream's order (a sample) of ``account``, behind what
        ``lane`` has ready now."""
        with self._lock:
            self._take(Samples(account), size)
            self._queue(Samples(account), size, job, lane)
            self._lock.notify_all()

    def release_positions(self) -> None:
        """Every request held for a position goes now (the server is shutting down: each is
        refused at its turn instead of waiting for a predecessor that will not run)."""
        with self._lock:
            self._closing = True
            for stream in self._positions:
                held = self._held[stream]
                for seq in sorted(held):
                    for size, job in held.pop(seq):
                        self._queue(stream, size, job)
            self._lock.notify_all()

    def stop(self) -> None:
        """Run what is released already (each job then finds its server stopped), then end."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    def _account(self, key: Key) -> str:
        return key.account if isinstance(key, Samples) else self._accounts.get(key, "")

    def _check_room(self, key: Key, size: int, *, needed: bool) -> None:
        """Refuse a call past the bounds, unless nothing waits before it (of ``key``; of its
        account's, for the total) or it is ``needed``: the next ``seq`` while the stream's jobs
        are held and none is ready to run."""
        waiting = self._waiting[key]
        what = f"{self._nouns.get(key, self._noun)} {key!r}" if isinstance(key, str) else "samples"
        needed = needed and waiting.ready == 0
        full = waiting.calls >= self._max_held or waiting.size + size > self._max_bytes
        if full and waiting.calls and not needed:
            held = f"({waiting.size} bytes of decoded requests held)"
            if isinstance(key, str) and key not in self._positions and waiting.ready == 0:
                raise ResourceExhausted(
                    f"{what}: {waiting.calls} calls wait for seq_id {self._next[key]}; send it "
                    f"first {held}"
                )
            raise ResourceExhausted(
                f"{what}: {waiting.calls} calls wait to run; retry later {held}"
            )
        account = self._account(key)
        total = self._totals[account]
        over = total + size > self._max_total and not (needed and waiting.calls)
        if over and any(w.calls for k, w in self._waiting.items() if self._account(k) == account):
            raise ResourceExhausted(
                f"{what}: this key holds {total} bytes of decoded requests waiting or running, "
                f"its bound is {self._max_total}; retry later"
            )

    def _take(self, key: Key, size: int) -> None:
        waiting = self._waiting[key]
        waiting.calls, waiting.size = waiting.calls + 1, waiting.size + size
        self._totals[self._account(key)] += size

    def _ended(self, released: _Released) -> None:
        """A job has run: its bytes are free, and a run's position may have moved."""
        with self._lock:
            key = released.key
            self._waiting[key].size -= released.size
            self._totals[released.account] -= released.size
            if key in self._positions:
                self._release(key)

    def _set_lane(self, stream: str, lane: str) -> None:
        if lane:
            self._lanes[stream] = lane
        else:
            self._lanes.pop(stream, None)

    def _queue(self, key: Key, size: int, job: Job, lane: str = "") -> None:
        """Release ``job``: it runs in its lane's turn (a stream's own lane; ``lane`` for an
        unordered job)."""
        if isinstance(key, str):
            lane = self._lanes.get(key, "")
        self._ready.put(lane, _Released(key, size, job, self._account(key)))
        self._waiting[key].ready += 1

    def _floor(self, stream: str) -> int:
        """The highest number of ``stream`` that may be released now."""
        positions = self._positions.get(stream)
        if positions is None:
            return self._next[stream]
        self._next[stream] = max(self._next[stream], positions.position())
        return self._next[stream]

    def _release(self, stream: str) -> None:
        held = self._held[stream]
        while held and min(held) <= self._floor(stream):
            seq = min(held)
            for size, job in held.pop(seq):
                self._queue(stream, size, job)
            if seq == self._next[stream]:
                self._next[stream] += 1
        self._lock.notify_all()

    def _release_idle(self) -> float | None:
        """Let the first held request of each run's stream go once nothing has run for its
        ``idle_release_s``; how long to wait before looking again (None: nothing is held)."""
        if self._beside:
            return None  # something runs: looked at again when it ends
        wait: float | None = None
        idle = time.monotonic() - self._active_at
        for stream, positions in self._positions.items():
            held = self._held[stream]
            if not held:
                continue
            left = positions.idle_release_s - idle
            if left <= 0:
                self._next[stream] = max(self._next[stream], min(held))
                self._release(stream)
            else:
                wait = left if wait is None else min(wait, left)
        return wait

    def _loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    wait = self._release_idle()  # may release a held job: looked at first
                    if self._ready or self._stopped:
                        break
                    self._lock.wait(wait)
                if self._stopped and not self._ready:
                    return
                turn = self._ready.peek()
                assert turn is not None
                lane, first = turn
            if isinstance(first.key, str):
                # Waits for the samples started before it, still counted as waiting (only this
                # thread takes from the queue, and what is put meanwhile queues behind this
                # turn, so the turn and its first job stay the same).
                self._samples.wait()
                (counted,) = self._begin(lane, more=0)
                try:
                    self._run(counted)
                finally:
                    with self._lock:
                        self._active_at = time.monotonic()
            else:
                for counted in self._begin(lane, more=self._samples.free() - 1):
                    self._samples.start(counted)

    def _begin(self, lane: str, *, more: int) -> list[Job]:
        """The job whose turn it is, and up to ``more`` unordered ones behind it at the head of
        its ``lane``, in the same turn (they decode as one batch); none waits from now."""
        with self._lock:
            first = self._ready.take()
            assert first is not None
            taken = [first, *self._ready.take_more(lane, _is_unordered, more)]
            self._active_at = time.monotonic()
            for released in taken:
                waiting = self._waiting[released.key]
                waiting.calls, waiting.ready = waiting.calls - 1, waiting.ready - 1
        return [partial(self._counted, released) for released in taken]

    def _counted(self, released: _Released) -> None:
        """A released job, its bytes held until it has ended. A job answers its own caller; one
        that raises anyway is logged, and the order goes on with the next."""
        try:
            released.job()
        except Exception:
            logger.exception("a job of the order raised")
        finally:
            self._ended(released)


def _is_unordered(released: _Released) -> bool:
    return isinstance(released.key, Samples)


class _Beside:
    """Jobs run beside each other, each on a daemon thread of its own (one that never ends
    then never holds up the process's exit), at most ``limit`` at once."""

    def __init__(self, run: Callable[[Job], None], limit: int) -> None:
        self._run = run
        self._limit = limit
        self._slots = threading.Semaphore(limit)
        self._idle = threading.Condition()
        self._running = 0

    def start(self, job: Job) -> None:
        self._slots.acquire()
        with self._idle:
            self._running += 1
        threading.Thread(target=self._go, args=(job,), name="unordered-job", daemon=True).start()

    def free(self) -> int:
        """How many jobs may start now without waiting for a slot (at least; one may free
        meanwhile)."""
        with self._idle:
            return self._limit - self._running

    def wait(self) -> None:
        """Until every job started has ended."""
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0)

    def _go(self, job: Job) -> None:
        try:
            self._run(job)
        finally:
            self._slots.release()
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

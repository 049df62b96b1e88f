"""The scheduler: the one queue every run's work waits in, and the one thread that runs it.

One engine thread, so nothing interleaves inside the engine and torch always runs on the same
thread. Every job (``scheduler_jobs.Job``) is *ready* or *held*:

- A job of a numbered stream is held until its predecessor was released. A Tinker model is a
  stream: the SDK numbers a training client's calls with ``seq_id`` from 1 and may send them out
  of order (a big batch's chunks go in parallel, the first one last). A run's positions are a
  stream too (``start_positions``): a gRPC caller numbers each state-changing request with the
  position it expects the run at (``expected_position``), and pipelined requests may arrive out
  of order on separate HTTP/2 streams. One of them waits until the requests before it were
  released, or the run is at its position already (a retried key is then answered from the
  journal, a stale position refused by the position check); its predecessor may never come
  (never sent, or the server restarted and restored an older state), so once nothing has run
  for the stream's ``idle_release_s`` the first one held goes ahead and the position check
  refuses it with the real position. A request held counts as activity when it arrives: after a
  quiet spell a pipelined call that overtook its predecessor by a moment waits for it. A refused
  request does not move the position, so the ones released behind it are refused the same way.
- Ready jobs take fair turns by lane (``fair_turns.FairTurns``, weighted by ``weight_of``: a
  run's tenant's weight): within a lane in the order they became ready, and lanes with work one
  job each. A run that floods the queue therefore never delays another run's next job by more
  than one job of each other lane with work; with one lane the queue is first in, first out.
- Samples at the head of the lane whose turn it is decode together as one batch
  (``sample_batching``), never across a job queued before them in their lane; one queued while
  the batch decodes joins it while no other job was queued meanwhile (``epoch``). The sample at
  the head of each other lane joins too where it may decode beside them bit for bit
  (``together_problem``: LoRA runs of one base reading their live weights), spending its
  lane's turn (``samples_together`` counts those decodes).
- A barrier (``wait_idle``, ``release``) runs once every job queued before it has run.

Every bound is checked once, when a job is accepted, per *account* (a tenant; "" for a server
without tenants), and never after: an accepted job runs, whatever other accounts send.

- Callers that wait on their job (gRPC handlers, each holding a server thread) count from their
  ``admitted`` block on: past ``max_queued`` of one account a new one is refused
  (RESOURCE_EXHAUSTED), so threads stay free for health checks, ``Info`` and other tenants.
- What is accepted and has not run yet is bounded per stream (and for the samples, per account)
  in jobs and in bytes, and in bytes over all of an account's together. The bytes are what a
  request holds in memory once decoded (its transport estimates them before it is accepted),
  counted from acceptance until its job has run. Past a bound a request is refused with
  ``ResourceExhausted`` (429 / RESOURCE_EXHAUSTED: clients retry it) before it is recorded,
  except one that nothing accepted waits before, and the one request a stream's held ones wait
  for (nothing of the stream could run without it).

``_take_turn`` takes the one job whose turn it is; where ready jobs of several runs are seen
together. A job that may share a pass over its base (``Job.shared``: a LoRA run's
forward_backward or forward) takes with it the ready head job of each other lane that can share
it (``shared_passes``), each spending its own lane's turn (``FairTurns.take_out_of_turn``): one
job per lane per pass, so a run with many waiting calls gets no more passes than its turns. A
job is ready only once its predecessor in its stream has run, so each run's calls still apply
in its order, each once. ``shared_passes`` counts the passes run so (``shared_jobs`` the jobs
in them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

from trainwire.server.errors import (
    AlreadyExists,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
)
from trainwire.server.service import shared_passes
from trainwire.server.service.fair_turns import FairTurns
from trainwire.server.service.sample_batching import (
    PreparedSample,
    decode_alone,
    decode_batch,
    together_problem,
)
from trainwire.server.service.scheduler_jobs import Holder, Job, Samples, Shared

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_QUEUED = 24  # of the server's default 32 handler threads, 8 stay free for the rest
DEFAULT_MAX_HELD = 1024  # requests waiting to run, per stream and account's samples; more refused
# Bytes of decoded requests accepted and not yet run, per stream and account's samples. A maximal
# forward_backward holds about 240 MiB decoded (1,048,576 positions x 6 per-token values x 40
# bytes, ``codec.held_bytes``); the SDK sends a batch as chunks of 5 MB of wire, at most 50 MB in
# flight, about 600 MiB once decoded. 1 GiB takes the SDK's whole window, or four maximal calls,
# behind the one running: a pipelining loop is not refused, and 30 maximal calls (7 GiB) are.
DEFAULT_MAX_HELD_BYTES = 1024 * 1024 * 1024
# The same over every stream and the samples of one account together: one stream's bound and half
# of it again for the samples beside it, so what one tenant's requests hold stays a small part of
# a training host's memory.
DEFAULT_MAX_TOTAL_BYTES = 1536 * 1024 * 1024
SETTLE_S = 0.02  # the longest a batch of samples waits for samples still arriving
SETTLE_STEP_S = 0.002  # samples arriving further apart than this start apart


@dataclass(frozen=True)
class _Positions:
    """A stream numbered by a run's position: where the run is now, and how long nothing may
    have run before the first held request goes ahead anyway."""

    position: Callable[[], int]
    idle_release_s: float


@dataclass
class _Waiting:
    """The jobs of one holder: ``calls`` not yet running, ``ready`` of them released, and the
    ``size`` in bytes of every one accepted whose job has not ended."""

    calls: int = 0
    size: int = 0
    ready: int = 0


class Scheduler:
    """The one queue and its engine thread (see the module docstring).

    Args:
        max_queued: waiting callers per account (``admitted``).
        max_held, max_bytes: jobs and bytes per stream and per account's samples.
        max_total_bytes: bytes over all of one account's jobs.
        noun: what a stream is called in refusals (a Tinker stream is a ``model``).
        weight_of: a lane's share of the turns (see ``FairTurns``).
    """

    def __init__(
        self,
        *,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_held: int | None = None,
        max_bytes: int | None = None,
        max_total_bytes: int | None = None,
        noun: str = "stream",
        weight_of: Callable[[str], float] | None = None,
    ) -> None:
        self.max_queued = max_queued
        self._max_held = DEFAULT_MAX_HELD if max_held is None else max_held
        self._max_bytes = DEFAULT_MAX_HELD_BYTES if max_bytes is None else max_bytes
        self._max_total = DEFAULT_MAX_TOTAL_BYTES if max_total_bytes is None else max_total_bytes
        self._noun = noun
        self._lock = threading.Condition()
        # Ready jobs, in fair turns by lane; barriers apart (they wait for lower arrivals).
        self._turns: FairTurns[Job] = FairTurns(weight_of)
        self._barriers: deque[Job] = deque()
        self._arrivals = 0
        # Jobs accepted before the server restored its runs, in order (``recovered``).
        self._before_recovery: list[Job] | None = []
        # Moves with every job made ready that samples may not decode beside.
        self.epoch = 0
        # Admission of waiting callers.
        self.waiting = 0
        self._waiting_of: Counter[str] = Counter()
        self.queued = 0  # jobs ready, held or running
        # Numbered streams.
        self._next: dict[str, int] = {}
        self._held: dict[str, dict[int, list[Job]]] = {}  # seq → jobs
        self._positions: dict[str, _Positions] = {}
        self._nouns: dict[str, str] = {}
        self._lanes: dict[str, str] = {}
        self._accounts: dict[str, str] = {}
        self._seen: dict[tuple[str, int], str] = {}  # (stream, seq) → payload digest
        self._beside = 0  # keyed calls without a position queued or running (``running_beside``)
        self._closing = False  # the server is shutting down: nothing is held for a position
        self._active_at = time.monotonic()  # when a job last started or ended
        # Bounds of what is accepted and has not run.
        self._counts: defaultdict[Holder, _Waiting] = defaultdict(_Waiting)
        self._totals: defaultdict[str, int] = defaultdict(int)
        self._released = False
        self._stopping = False
        # Passes shared by jobs of several runs, and the jobs that ran in them (``_run_shared``).
        self.shared_passes = 0
        self.shared_jobs = 0
        self.samples_together = 0  # decodes that began with samples of several runs
        self._thread = threading.Thread(target=self._serve, name="trainwire-engine", daemon=True)
        self._thread.start()

    # -- callers that wait ------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether any job is ready, held or running."""
        return self.queued > 0

    def ready_lanes(self, which: Callable[[Job], bool]) -> list[str]:
        """The lanes whose next ready job is ``which`` (e.g. one that may share a pass, or a
        sample): what the next turn that takes several lanes' jobs together looks at."""
        with self._lock:
            heads = self._turns.lane_heads()
        return [lane for lane, job in heads if which(job)]

    @property
    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

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

    def run(self, call: Callable[[], T], *, lane: str = "") -> T:
        """``call()`` on the engine thread in ``lane``'s turn, after everything queued before it
        in ``lane``; at once when called on the engine thread (a job's own call)."""
        return self.queue(call, lane=lane).result()

    def queue(
        self,
        call: Callable[[], Any] | None = None,
        *,
        prepare: Callable[[], PreparedSample] | None = None,
        lane: str = "",
        shared: Shared | None = None,
    ) -> futures.Future[Any]:
        """``run`` without waiting (or, given ``prepare``, a sample decoded in ``lane``'s turn
        with the samples queued beside it): the job's future, done before this returns when
        called on the engine thread (a job's own call).
        ``shared``: the job may run as its part of a pass shared with other lanes' jobs."""
        if self.on_engine_thread:
            done: futures.Future[Any] = futures.Future()
            try:
                done.set_result(call() if prepare is None else _decode_now(prepare))
            except BaseException as error:  # its caller hears it from the future
                done.set_exception(error)
            return done
        job = Job(call=call, prepare=prepare, lane=lane, shared=shared)
        with self._lock:
            if self._released:
                raise Unavailable("the server has stopped")
            self._make_ready(job)
        return job.done

    @contextlib.contextmanager
    def running_beside(self, stream: str) -> Iterator[None]:
        """Around a call that moves ``stream``'s run outside its positions (a keyed call without
        one): requests held for a position wait while it is queued or runs, and look at the
        position again when it ends."""
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
                self._lock.notify_all()  # the idle release counts from now

    # -- streams ---------------------------------------------------------------------------------

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
        model's ``seq_id``); ``noun`` names it in refusals; its jobs take ``lane``'s turns; its
        bytes count against ``account``'s."""
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
        """A stream numbered by a run's position: ``position()`` is where the run is now.
        Starting it again (the run reopened or restored) takes the new position."""
        with self._lock:
            self._positions[stream] = _Positions(position, idle_release_s)
            self._set_lane(stream, lane)
            self._nouns[stream] = "run"
            self._next[stream] = position()
            self._held.setdefault(stream, {})
            self._release(stream)

    def started(self, stream: str) -> bool:
        with self._lock:
            return stream in self._next

    def end_stream(self, stream: str) -> None:
        """The stream ended (its model or run closed): its held jobs are made ready (and fail
        at their turn, as their callers decide), and no request of it is accepted any more."""
        with self._lock:
            held = self._held.pop(stream, {})
            for seq in sorted(held):
                for job in held[seq]:
                    self._make_ready(job)
            self._next.pop(stream, None)
            self._positions.pop(stream, None)
            self._lanes.pop(stream, None)
            self._accounts.pop(stream, None)
            self._seen = {key: value for key, value in self._seen.items() if key[0] != stream}

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
        call: Callable[[], Any],
        *,
        size: int = 0,
        bounded: bool = True,
        after_recovery: bool = False,
        shared: Shared | None = None,
    ) -> bool:
        """Accept ``call`` (or ``shared``'s part of a shared pass) as ``seq`` of ``stream``,
        holding ``size`` bytes until it has run (see ``accepts``; False for a re-send)."""
        with self._lock:
            if not self.accepts(stream, seq, digest, size, bounded=bounded):
                return False
            self._seen[(stream, seq)] = digest
            job = Job(call=call, size=size, after_recovery=after_recovery, shared=shared)
            self._accept(job, stream)
            self._held[stream][seq] = [job]
            self._release(stream)
            return True

    def submit_at(
        self,
        stream: str,
        position: int,
        call: Callable[[], T],
        *,
        shared: Shared | None = None,
    ) -> futures.Future[T]:
        """Queue ``call`` (or ``shared``'s part of a shared pass), which expects the run of
        ``stream`` at ``position``, in position order (see the module docstring); its future.
        ``FailedPrecondition`` for a stream not started, ``ResourceExhausted`` when its
        requests are at their bound."""
        with self._lock:
            if stream not in self._positions:
                raise FailedPrecondition(f"run {stream!r} is not open on this server")
            self._check_room(stream, 0, needed=position <= self._floor(stream))
            job = Job(call=call, shared=shared)
            self._accept(job, stream)
            if self._closing:  # refused at its turn: no predecessor will run
                self._make_ready(job)
            else:
                self._held[stream].setdefault(position, []).append(job)
                self._active_at = time.monotonic()  # its predecessor may be a moment behind it
                self._release(stream)
        return job.done

    def check_room(self, size: int = 0, *, account: str = "") -> None:
        """ResourceExhausted when ``account``'s samples are at their bound, in jobs or bytes, or
        the bytes of all of ``account``'s are; what other accounts hold does not count."""
        with self._lock:
            self._check_room(Samples(account), size, needed=False)

    def run_unordered(
        self,
        call: Callable[[], Any] | None = None,
        size: int = 0,
        *,
        prepare: Callable[[], PreparedSample | None] | None = None,
        lane: str = "",
        account: str = "",
        after_recovery: bool = False,
    ) -> futures.Future[Any]:
        """Queue a job outside any stream's order of ``account`` (a sample given as ``prepare``,
        or a plain ``call``), behind what ``lane`` has ready now; its future."""
        job = Job(call, prepare, lane=lane, size=size, after_recovery=after_recovery)
        with self._lock:
            self._accept(job, Samples(account))
            self._make_ready(job)
        return job.done

    def release_positions(self) -> None:
        """Every request held for a position goes now (the server is shutting down: each is
        refused at its turn instead of waiting for a predecessor that will not run)."""
        with self._lock:
            self._closing = True
            for stream in self._positions:
                held = self._held[stream]
                for seq in sorted(held):
                    for job in held.pop(seq):
                        self._make_ready(job)

    def recovered(self) -> None:
        """The server restored its runs: the jobs accepted to run after that are ready now."""
        with self._lock:
            waiting, self._before_recovery = self._before_recovery or [], None
            for job in waiting:
                self._make_ready(job)

    # -- barriers --------------------------------------------------------------------------------

    def _after_all(self, last: Callable[[], T]) -> futures.Future[T]:
        """``last`` on the engine thread once every job queued before it has run, in any lane
        (jobs queued after it may run first)."""
        barrier = Job(call=last)
        with self._lock:
            barrier.arrival = self._arrival()
            self._barriers.append(barrier)
            self.queued += 1
            self._lock.notify_all()
        return barrier.done

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing queued before this call runs; False if ``timeout_s`` passed."""
        try:
            self._after_all(lambda: None).result(timeout=timeout_s)
        except futures.TimeoutError:
            return False
        return True

    def release(self, last: Callable[[], None]) -> None:
        """Run ``last`` after everything queued, then stop taking jobs (once)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._after_all(last).result()
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join()

    # -- bounds ----------------------------------------------------------------------------------

    def _account(self, holder: Holder) -> str:
        return holder.account if isinstance(holder, Samples) else self._accounts.get(holder, "")

    def _check_room(self, holder: Holder, size: int, *, needed: bool) -> None:
        """Refuse a request past the bounds, unless nothing waits before it (of ``holder``; of
        its account's, for the total) or it is ``needed``: the next ``seq`` while the stream's
        jobs are held and none is ready to run."""
        waiting = self._counts[holder]
        what = (
            f"{self._nouns.get(holder, self._noun)} {holder!r}"
            if isinstance(holder, str)
            else "samples"
        )
        needed = needed and waiting.ready == 0
        full = waiting.calls >= self._max_held or waiting.size + size > self._max_bytes
        if full and waiting.calls and not needed:
            held = f"({waiting.size} bytes of decoded requests held)"
            if isinstance(holder, str) and holder not in self._positions and waiting.ready == 0:
                raise ResourceExhausted(
                    f"{what}: {waiting.calls} calls wait for seq_id {self._next[holder]}; send "
                    f"it first {held}"
                )
            raise ResourceExhausted(
                f"{what}: {waiting.calls} calls wait to run; retry later {held}"
            )
        account = self._account(holder)
        total = self._totals[account]
        over = total + size > self._max_total and not (needed and waiting.calls)
        if over and any(w.calls for h, w in self._counts.items() if self._account(h) == account):
            raise ResourceExhausted(
                f"{what}: this key holds {total} bytes of decoded requests waiting or running, "
                f"its bound is {self._max_total}; retry later"
            )

    def _accept(self, job: Job, holder: Holder) -> None:
        """Count ``job`` against ``holder``'s bounds until it has run (under the lock)."""
        if self._released:
            raise Unavailable("the server has stopped")
        job.holder, job.account = holder, self._account(holder)
        if isinstance(holder, str):
            job.lane = self._lanes.get(holder, "")
        counts = self._counts[holder]
        counts.calls, counts.size = counts.calls + 1, counts.size + job.size
        self._totals[job.account] += job.size
        self.queued += 1

    # -- ready jobs ------------------------------------------------------------------------------

    def _arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def _make_ready(self, job: Job) -> None:
        """``job`` takes its lane's turns from now (under the lock)."""
        if job.holder is None:
            self.queued += 1
        else:
            self._counts[job.holder].ready += 1
        if job.after_recovery and self._before_recovery is not None:
            self._before_recovery.append(job)
            return
        job.arrival = self._arrival()
        if not job.is_sample:
            self.epoch += 1
        self._turns.put(job.lane, job)
        self._lock.notify_all()

    def _set_lane(self, stream: str, lane: str) -> None:
        if lane:
            self._lanes[stream] = lane
        else:
            self._lanes.pop(stream, None)

    def _floor(self, stream: str) -> int:
        """The highest number of ``stream`` that may be released now."""
        positions = self._positions.get(stream)
        if positions is None:
            return self._next[stream]
        self._next[stream] = max(self._next[stream], positions.position())
        return self._next[stream]

    def _release(self, stream: str) -> None:
        held = self._held.get(stream)
        while held and min(held) <= self._floor(stream):
            seq = min(held)
            for job in held.pop(seq):
                self._make_ready(job)
            if seq == self._next[stream]:
                self._next[stream] += 1
        self._lock.notify_all()  # the engine looks at the held requests again

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

    # -- the engine thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        """The engine thread: a barrier whose predecessors all ran, else the job whose turn it
        is (with the samples beside it); until released and drained."""
        while True:
            with self._lock:
                job = self._next_job()
                while job is None:
                    if self._stopping:
                        self._refuse_left()
                        return
                    self._lock.wait(self._release_idle())
                    job = self._next_job()
                self._active_at = time.monotonic()
            if job.is_sample:
                self._run_samples(job)
            elif job.shared is not None:
                self._run_shared(job)
            else:
                self._run_one(job)

    def _next_job(self) -> Job | None:
        """Under the lock: what runs next, taken out of the queue."""
        self._release_idle()
        oldest = min((job.arrival for job in self._turns.heads()), default=None)
        if self._barriers and (oldest is None or oldest > self._barriers[0].arrival):
            return self._barriers.popleft()
        return self._take_turn()

    def _take_turn(self) -> Job | None:
        """The job whose turn it is (``_run_shared`` takes the jobs that share its pass)."""
        job = self._turns.take()
        if job is not None:
            self._started(job)
        return job

    def _started(self, job: Job) -> None:
        if job.holder is not None:
            counts = self._counts[job.holder]
            counts.calls, counts.ready = counts.calls - 1, counts.ready - 1

    def _run_one(self, job: Job) -> None:
        assert job.call is not None
        job.outcome = futures.Future()
        try:
            job.outcome.set_result(job.call())
        except BaseException as error:
            job.outcome.set_exception(error)
        finally:
            self._close(job)

    def _run_shared(self, first: Job) -> None:
        """``first``'s turn, with the heads of the other lanes that share its pass (see
        ``shared_passes``); alone when none does, or when the pass changed nothing and failed.
        Only this thread takes jobs, so the heads looked at stay heads until taken."""
        with self._lock:
            heads = [
                job
                for _, job in self._turns.heads_after(first.lane)
                if not job.is_sample and shared_passes.may_join(first, job)
            ]
        request = shared_passes.begin(first) if heads else None
        if request is None:
            self._run_one(first)
            return
        begun = [(first, request)]
        for job in heads:
            other = shared_passes.begin(job)
            if other is not None:
                begun.append((job, other))
        joined, invariance = shared_passes.group(begun)
        if len(joined) < 2 or invariance is None:
            self._run_one(first)
            return
        jobs = [job for job, _ in joined]
        with self._lock:
            for job in jobs[1:]:
                taken = self._turns.take_out_of_turn(job.lane)
                assert taken is job
                self._started(job)
        assert first.shared is not None
        if not shared_passes.run_pass(joined, invariance, backward=first.shared.backward):
            for job in jobs:
                self._run_one(job)
            return
        self.shared_passes += 1
        self.shared_jobs += len(jobs)
        logger.debug("one pass of %d runs: %s", len(jobs), [job.lane for job in jobs])
        for job in jobs:
            self._close(job)

    def _close(self, job: Job) -> None:
        """A job has run: it has ended before its caller hears of it, so a caller that asks
        what runs once answered finds its own job gone."""
        self._ended(job)
        outcome = job.outcome
        assert outcome is not None and outcome.done()
        error = outcome.exception()
        if error is None:
            job.done.set_result(outcome.result())
        else:
            job.done.set_exception(error)

    def _ended(self, job: Job) -> None:
        """A job has run: its bytes are free, and a run's position may have moved."""
        with self._lock:
            self.queued -= 1
            self._active_at = time.monotonic()
            holder = job.holder
            if holder is not None:
                self._counts[holder].size -= job.size
                self._totals[job.account] -= job.size
                if holder in self._positions:
                    self._release(holder)

    def _refuse_left(self) -> None:
        """Under the lock, stopping: what never ran (a request accepted before a recovery that
        did not come) hears that the server stopped; it stays recorded where its transport
        keeps it."""
        while (job := self._turns.take()) is not None:
            job.done.set_exception(Unavailable("the server has stopped"))

    # -- samples ---------------------------------------------------------------------------------

    def _run_samples(self, first: Job) -> None:
        """A sample's turn: it and the samples right behind it in its lane that read the same
        weights, as one decode."""
        batch: list[tuple[Job, PreparedSample]] = []
        try:
            prepared = self._prepare(first)
            if prepared is None:
                return
            batch.append((first, prepared))
            if prepared.announced:
                decode_alone(prepared)
                return
            if not prepared.batches:
                decode_batch([prepared], lambda: [])
                return
            self._settle()
            epoch = self.epoch
            batch += self._take_samples(first.lane, prepared)
            other_runs = self._take_other_runs_samples(first.lane, prepared)
            batch += other_runs
            if other_runs:
                self.samples_together += 1

            def join() -> list[PreparedSample]:
                if self.epoch != epoch:  # another job waits: nothing joins
                    return []
                more = self._take_samples(first.lane, prepared)
                if other_runs:  # a batch of several runs: any run's sample that may, joins
                    more += self._take_other_runs_samples(first.lane, prepared)
                batch.extend(more)
                return [p for _, p in more]

            decode_batch([p for _, p in batch], join)
        finally:
            for job in [first, *(job for job, _ in batch if job is not first)]:
                self._close(job)

    def _prepare(self, job: Job) -> PreparedSample | None:
        """What a sample job reads (its answer is the job's outcome); None when it has its
        outcome already (nothing to run, or ``prepare`` failed). Prepared once: a job looked at
        behind a batch of other weights keeps what it reads for its own turn."""
        assert job.prepare is not None
        if job.outcome is not None:
            return job.prepared
        job.outcome = futures.Future()
        try:
            prepared = job.prepare()
        except BaseException as error:
            job.outcome.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return None
        if prepared is None:
            job.outcome.set_result(None)
            return None
        job.outcome, job.prepared = prepared.answer, prepared
        return prepared

    def _take_samples(self, lane: str, first: PreparedSample) -> list[tuple[Job, PreparedSample]]:
        """The sample jobs at the head of ``lane`` that read ``first``'s weights, taken out of
        the queue; one with its outcome at once (``_prepare``) is taken and closed on the way."""
        taken: list[tuple[Job, PreparedSample]] = []
        while True:
            with self._lock:
                head = self._turns.head_of(lane)
                if head is None or not head.is_sample:
                    return taken
            prepared = self._prepare(head)  # still at its lane's head: only this thread takes
            if prepared is not None and prepared.weights != first.weights:
                return taken
            with self._lock:
                self._turns.take_more(lane, lambda job, head=head: job is head, 1)
                self._started(head)
            if prepared is None:
                self._close(head)
            else:
                taken.append((head, prepared))

    def _take_other_runs_samples(
        self, lane: str, first: PreparedSample
    ) -> list[tuple[Job, PreparedSample]]:
        """The sample job at the head of each other lane that may decode in ``first``'s batch
        (``sample_batching.together_problem``: several runs' samples in one decode, each the
        bits it gets alone), each taken out of its lane's turn and spending it, so a run's
        samples get no more room in the decodes than its turns. One looked at and left keeps
        what it reads for its own turn (``_prepare``)."""
        with self._lock:
            heads = [(other, job) for other, job in self._turns.heads_after(lane) if job.is_sample]
        taken: list[tuple[Job, PreparedSample]] = []
        for other, head in heads:
            prepared = self._prepare(head)  # still its lane's head: only this thread takes
            if prepared is None or together_problem(first, prepared) is not None:
                continue
            with self._lock:
                job = self._turns.take_out_of_turn(other)
                assert job is head
                self._started(head)
            taken.append((head, prepared))
        return taken

    def _settle(self) -> None:
        """Wait while samples keep arriving, a few milliseconds at most: samples sent at one
        moment (a loop's futures) then start as one batch, where one arriving a step late would
        decode at another length, in tiles of its own (``batch_decode``)."""
        deadline = time.monotonic() + SETTLE_S
        seen = -1
        while time.monotonic() < deadline:
            arrived = self._arrivals
            if arrived == seen:
                break
            seen = arrived
            time.sleep(SETTLE_STEP_S)


def _decode_now(prepare: Callable[[], PreparedSample]) -> Any:
    """A sample asked for on the engine thread: decoded alone, at once."""
    prepared = prepare()
    decode_alone(prepared)
    return prepared.answer.result()

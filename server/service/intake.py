"""The intake: where a request that answers a ticket is accepted, ordered, recorded and answered.

A transport hands the intake each request with its stream and number (a Tinker model and its
``seq_id``) and a ``prepare`` closure that decodes the rest into a ``Submission`` (an operation of
the host's table, its request, and what the transport records once it applied); the
host checks the request there, once, and the intake answers the request id at once.
``{stream}/{seq}`` is both the request id and the operation key the host journals, bound to the
digest the intake took of the body (the one hash of a request), so a re-sent request finds its
ticket (and, after it ran, the journal's recorded result) instead of running again; the same key
with another payload is refused. The intake submits each request to the host as a ``Command``
numbered in its stream (``SessionHost.submit``, the one entry point of both transports: the
host's ``Scheduler`` runs it in order, on its engine thread, and bounds what waits) and answers
its request id from the command's ticket; results enter the ``ResultStore`` only once durable:
a keyed call's once its journal entry committed, every other result (a forward, a sample, a
failure) once written to the ``RequestStore``.

A stream is a run's (a server of many runs holds many Tinker models): where its compacted
records resume, and the position its restored run must have reached, are its own, so one
model's checkpoint compacts that model's records only, and closing a model forgets only its
own (``compact_at``, ``forget_stream``).

An unordered request (a sample) may be cancelled by its client (``cancel``): its ticket is
resolved at once as cancelled, durably (a restart answers the same), and the work is skipped at
its turn, or, already running, its result discarded. Ordered requests are never cancelled: each
holds its place in its stream's numbering, and the calls after it expect its effect.

Exactly once across a crash: each accepted request is stored before its request id is handed out. A
restarted intake reads the store back (``replaying``) before its transport serves: recorded results
are answered as they are, every other request is queued again in its original order (``replay``):
a call from its record, typed as it was accepted (its operation, its request, the run it was sent
to, its transport's note and encoder's name), with no transport decoding it again; a sample through
its transport (``sample_again``), which resolves its weights at its turn. One that cannot be
queued again fails alone (``replay_failed``). Nothing runs until the host has restored its run
(``recovered``); the engine restarted from its latest checkpoint, so the journal answers the keyed
calls before it and the ones since run again, the same bits. A checkpoint compacts the store
(``compact_at``): the results of the calls before it that a client may still ask for are carried,
bounded by ``results``'s retention.

Client sessions come and go (the Tinker front's model slot forgets them): a request is taken only
for a session the transport knows (``admit``); a forgotten session's results and records go at
once (one DELETE of its rows), and the transport forgets the lapsed sessions before each
compaction (``before_compaction``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from trainwire.contract.outcomes import OperationSpec
from trainwire.server.errors import InvalidArgument, ResourceExhausted, TrainwireError
from trainwire.server.service.active_run import Durable, JournalCommitFailed, wait_durable
from trainwire.server.service.commands import Applied, Command
from trainwire.server.service.host import SessionHost
from trainwire.server.service.operations import OPERATIONS, SAMPLE, Operation
from trainwire.server.service.reads import SampleResult
from trainwire.server.service.request_bodies import request_body, request_of
from trainwire.server.service.request_records import (
    Body,
    CallRecord,
    Record,
    ResultRecord,
    ResumeRecord,
    SampleRecord,
    payload,
)
from trainwire.server.service.request_store import RequestStore, Ticket, compacted, stream_of
from trainwire.server.service.requests import SampleRequest
from trainwire.server.service.results import (
    USER_ERRORS,
    Deferred,
    Done,
    Failed,
    Outcome,
    ResultStore,
    run_to_outcome,
)
from trainwire.server.service.sample_batching import PreparedSample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    """A request as its transport decoded it: the ``operation`` it runs on ``request`` (checked
    once, when the intake accepts it) for run ``run_id`` ("" the server's only run), and
    ``answer``, the name of the transport's encoder (``Intake.encoders``) that makes the
    operation's outcome the request's response: a keyed call's when it is fetched (off the
    engine thread: the journal holds the outcome), a read's before it is stored. ``note``
    (JSON: what the transport records once the operation applied, a Tinker save's catalog
    entry say) goes to the transport's one observer, ``Intake.applied``, and to its encoder.
    All of it is data, stored with the request (``CallRecord``), so a restart queues the call
    again as it was accepted. Whatever a call must find at its turn is checked by its operation
    (``ExportWeightsRequest.written_once``) or held from its acceptance on (a load's
    checkpoint), never by the transport at the turn."""

    operation: Operation[Any]
    request: Any
    answer: str
    note: dict[str, Any] | None = None
    run_id: str = ""


@dataclass(frozen=True)
class SampleSubmission:
    """A sample as its transport decoded it: ``prepare()``, at its turn, gives the run it
    reads ("" the server's only run) and its request (what it reads may change until then:
    a sampling session's weights); ``encode`` makes its samples the request's result."""

    prepare: Callable[[], tuple[str, SampleRequest]]
    encode: Callable[[SampleResult], Any]


class UnreadableCall(Exception):
    """A stored call this version cannot queue again: it fails alone, as the server's error."""


# A transport's encoder of a call's response: (its request, its note, the operation's outcome).
Encoder = Callable[[Any, dict[str, Any] | None, Any], Any]
RESOLVING_LOCKS = 64
CANCELLED = "cancelled by its client (cancel_future): {what}"


class Intake:
    """Orders, records and answers one transport's requests (its records in the host's ledger).

    Args:
        host: the session host its requests run on; the intake's jobs wait in its scheduler
            until it has restored its runs (``recovered``).
        owner_of: the client session a request id belongs to.
        noun: what the intake's streams are called in refusals (a Tinker ``model``).
        account_of: the tenant a stream or request id belongs to, whose bounds in the scheduler
            its requests fill ("": one account for all).
    """

    def __init__(
        self,
        host: SessionHost,
        owner_of: Callable[[str], str],
        noun: str,
        account_of: Callable[[str], str] = lambda identifier: "",
    ) -> None:
        self.host = host
        self.owner_of = owner_of
        self.account_of = account_of
        self.noun = noun
        self.results = ResultStore()
        self.store = RequestStore(host.ledger, owner_of)
        self.scheduler = host.scheduler  # one queue for every transport
        # The transport's encoders of responses, by the names its submissions give (``answer``).
        self.encoders: dict[str, Encoder] = {}
        # How the transport takes a stored sample again (``replay``): a sample's weights are
        # the transport's to resolve at its turn, so it is decoded again as it was sent.
        self.sample_again: Callable[[dict[str, Any]], Any] | None = None
        # Results (and keyed calls' journal entries) written and not yet committed, counted by
        # request id: each is answered once its commit lands (on the ledger's commit thread),
        # while the engine runs the next job.
        self._finishing: Counter[str] = Counter()
        self._finished = threading.Condition()
        self._lock = threading.Lock()  # orders request records with their submission
        # A result is checked against a cancel, written and resolved under its request's lock
        # (striped: results of different requests are written side by side, sharing commits).
        self._resolving = [threading.Lock() for _ in range(RESOLVING_LOCKS)]
        self._stopped = False
        # Why a stream's restored run is behind the stored requests, by stream (when it is).
        self._cannot_replay: dict[str, str] = {}
        self._replayed: dict[str, ResultRecord] | None = None  # recorded results, while replaying
        self._resubmitted: set[str] = set()  # request ids submitted again at start, unanswered
        # Where each stream's records were last compacted: its next seq and journal position.
        self._resumes: dict[str, ResumeRecord] = {}
        self._streams: set[str] = set()  # the streams taking requests now
        # What the transport plugs in: ``admit(request_id)`` raises NotFound for a request of a
        # session it does not know (and counts the request as its session's sign of life);
        # ``before_compaction()`` forgets the sessions that lapsed, so a compaction leaves their
        # records out.
        self.admit: Callable[[str], None] = lambda request_id: None
        self.before_compaction: Callable[[], None] = lambda: None
        # ``applied(request_id, note, outcome)``: the transport's observer of the submissions
        # that carry a ``note``, told on the engine thread once the operation applied (or the
        # journal answered it), before the next call of any stream runs.
        self.applied: Callable[[str, Any, Any], None] = lambda request_id, note, outcome: None

    def stop(self) -> None:
        """Take no turn any more: a request queued and not yet run stays stored, and the next
        start replays it."""
        self._stopped = True
        self._wait_finished()
        self.store.close()

    # -- restart -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def replaying(self) -> Iterator[list[Record]]:
        """The records read back at start; calls submitted meanwhile are not stored again, and
        those with a recorded result are answered with it. A result whose request's record was
        compacted away is answerable at once."""
        records = list(self.store.records)
        results = {r.request_id: r for r in records if isinstance(r, ResultRecord)}
        requested = {r.request_id for r in records if isinstance(r, CallRecord | SampleRecord)}
        for request_id, result in results.items():
            if request_id not in requested:
                self.results.restore(result.resolved())
        self._replayed = results
        try:
            yield records
        finally:
            self._replayed = None
            self.store.leave_bodies_on_disk()  # taken back: the heavy bodies stay in their rows
        if records:
            logger.info("intake: %d request records read back", len(records))

    @property
    def taking_back(self) -> bool:
        """Whether the records read at start are being submitted again now (a sample's route
        then finds the sampling sessions it was accepted for)."""
        return self._replayed is not None

    def start_stream(self, stream: str, next_seq: int = 1, *, run_id: str = "") -> None:
        """Take requests of ``stream`` (a Tinker model, training run ``run_id``), numbered from
        ``next_seq``; they take that run's turns in the order (``host.lane_of``)."""
        with self._lock:
            self._streams.add(stream)
        lane, account = self.host.lane_of(run_id), self.account_of(stream)
        self.scheduler.start_stream(stream, next_seq, noun=self.noun, lane=lane, account=account)

    def resume_at(self, record: ResumeRecord, *, run_id: str = "") -> None:
        """``record``'s stream's compacted records go on at its seq_id and journal position."""
        self.start_stream(record.stream, record.next_seq, run_id=run_id)
        self._resumes[record.stream] = record

    def end_stream(self, stream: str) -> None:
        """``stream`` ended (its model closed): it takes no request any more, its held calls
        fail at their turn, and the store forgets its calls (``forget_stream``)."""
        with self._lock:
            self._streams.discard(stream)
            self._resumes.pop(stream, None)
        self.scheduler.end_stream(stream)

    def _resume_records(self) -> list[ResumeRecord]:
        """Where each open stream's compacted records resume (a compacted store's head); under
        ``_lock``."""
        return [self._resumes[s] for s in sorted(self._resumes) if s in self._streams]

    def replay_pending(self) -> bool:
        """Whether a call submitted again at start is unanswered yet (it may create a sampler)."""
        self._resubmitted = {r for r in self._resubmitted if self.results.pending(r)}
        return self._replayed is not None or bool(self._resubmitted)

    def replay(self, records: list[Record]) -> None:
        """Queue every stored request without a recorded result again, in its original order:
        inside ``replaying``, before the transport serves. A call is queued from its record
        (its operation on its typed request, as accepted: nothing is decoded or checked
        again), a sample given to the transport again (``sample_again``). A request that
        cannot be queued again, whatever the error, fails alone (``replay_failed``): one bad
        record never keeps the server from starting."""
        for record in records:
            if isinstance(record, CallRecord | SampleRecord):
                self._resubmit(record)

    def _resubmit(self, record: CallRecord | SampleRecord) -> None:
        self._resubmitted.add(record.request_id)
        try:
            if isinstance(record, CallRecord):
                self._requeue(record)
            elif self.sample_again is None:
                raise LookupError("no transport takes a stored sample again")
            else:
                self.sample_again(record.body)
        except Exception as error:  # its stream ended, its session forgotten, a bad record
            if self.replay_failed(record, error):
                logger.warning("intake: %s failed on replay: %r", record.request_id, error)
            else:
                logger.info("intake: %s refused again: %s", record.request_id, error)

    def replay_failed(self, record: CallRecord | SampleRecord, error: Exception) -> bool:
        """A stored request that could not be queued again fails alone: its ticket
        answers the failure (logged; a ``server`` one unless the error is the caller's), it
        takes its seq_id so the calls after it run, and the start goes on. False when it was
        queued before failing (a refusal again): its turn answers it."""
        request_id = record.request_id
        category = "user" if isinstance(error, USER_ERRORS) else "server"
        failure = Failed(
            f"replaying this request failed: {type(error).__name__}: {error}", category
        )
        digest = record.digest if isinstance(record, CallRecord) else payload(record.body)[0]
        job = self._job(request_id, failure)
        stream = request_id.rpartition("/")[0]
        with self._lock:
            if self.results.known(request_id):
                return False
            self.results.add(request_id, digest)
            if isinstance(record, CallRecord) and self.scheduler.started(stream):
                with contextlib.suppress(TrainwireError):  # its seq_id cannot be taken
                    if self.scheduler.submit(
                        stream, record.seq, digest, job, bounded=False, after_recovery=True
                    ):
                        return True
            account = self.account_of(request_id)
            self.scheduler.run_unordered(job, account=account, after_recovery=True)
            return True

    def recovered(self, position_of: Callable[[str], int]) -> None:
        """The host restored its runs, stream ``s``'s at journal position ``position_of(s)``:
        submitted calls may run now. A stream whose run restored a position before the
        checkpoint its records were compacted at fails its calls alone."""
        for stream, resume in self._resumes.items():
            position = position_of(stream)
            if position < resume.position:
                self._cannot_replay[stream] = (
                    f"the engine restored position {position}, before the checkpoint the request "
                    f"store was compacted at ({resume.position}): this run cannot go on exactly "
                    "once"
                )
                logger.error("intake: %s: %s", stream, self._cannot_replay[stream])
        self.scheduler.recovered()

    def _recorded(self, request_id: str) -> ResultRecord | None:
        return self._replayed.get(request_id) if self._replayed is not None else None

    # -- records -------------------------------------------------------------------------------

    def record(self, record: Record) -> None:
        """Write ``record`` durably (not while replaying: it is stored already)."""
        if self._replayed is None:
            with self._lock:
                self.store.write(record)

    def _append(self, record: Record) -> Ticket | None:
        """Store a request (not while replaying one); its ticket for ``store.sync``."""
        return None if self._replayed is not None else self.store.append(record)

    def compact_at(
        self, stream: str, seq_id: int, position: int, head: Callable[[], list[Record]]
    ) -> None:
        """After ``stream``'s checkpoint ``seq_id`` (journal ``position``), on the calls'
        thread: drop the records of ``stream`` a restart no longer needs (and the samples
        answered), carrying the results a client may still ask for; other streams' records
        stay for their own checkpoints. ``head`` (what the transport must know first: sessions,
        notes) is read while no record can be appended."""
        self._wait_finished()  # every call before it is answered now
        self.before_compaction()
        resume = ResumeRecord(seq_id, position, stream)

        def choose(records: list[Record]) -> list[Record] | None:
            others = [r for r in self._resume_records() if r.stream != stream]
            first = [*head(), *others, resume]
            return compacted(
                records, stream, seq_id, self._settled, first, self._carry, self._ordered
            )

        with self._lock:
            if self.store.compact(choose):
                self._resumes[stream] = resume

    def forget_stream(self, stream: str, head: Callable[[], list[Record]]) -> None:
        """``stream`` ended (``end_stream``): none of its calls replays again, so its records
        go, carrying the results still kept; ``head`` and every other stream's records stay."""
        self.before_compaction()

        def choose(records: list[Record]) -> list[Record]:
            requests = [
                r for r in records if isinstance(r, CallRecord | SampleRecord | ResultRecord)
            ]
            gone = [r.request_id for r in requests if stream_of(r.request_id) == stream]
            kept = [r for r in requests if stream_of(r.request_id) != stream]
            return [*head(), *self._resume_records(), *self._carry(gone), *kept]

        with self._lock:
            self.store.compact(choose)

    def _ordered(self, stream: str) -> bool:
        """Whether ``stream`` takes ordered calls now (its records wait for its checkpoints)."""
        return stream in self._streams

    def forget_sessions(self, sessions: set[str], known: Callable[[str], bool]) -> None:
        """The transport forgot client ``sessions``: the results of every session not ``known`` go
        (theirs, and any a restart read back for a session that had ended), and their records
        leave the store, so a restart does not bring them back."""
        with self._lock:
            self.results.forget(lambda request_id: not known(self.owner_of(request_id)))
            try:
                self.store.forget(sessions)
            except (OSError, ResourceExhausted) as error:
                # Gone from memory all the same: a restart takes them back, and they lapse again.
                logger.warning("intake: forgotten sessions not removed from the store: %s", error)

    def _settled(self, request_id: str) -> bool:
        return not self.results.pending(request_id)

    def _carry(self, request_ids: list[str]) -> list[ResultRecord]:
        """The results of ``request_ids`` that retention keeps, to carry in a compacted store."""
        return [ResultRecord.of(r) for r in self.results.retained(request_ids).values()]

    # -- submitting ----------------------------------------------------------------------------

    def resolve_now(self, request_id: str, outcome: Outcome) -> None:
        """A request answered as it is made (the Tinker front's create_model)."""
        self.results.add(request_id)
        self.results.resolve(request_id, outcome)

    def submit(
        self,
        body: Body,
        stream: str,
        seq: Any,
        prepare: Callable[[], Submission],
        *,
        identity: Any = None,
        size: int | None = None,
    ) -> str:
        """Queue ``prepare()``'s submission as ``seq`` of ``stream``; its request id, once the
        request is stored durably. A keyed operation's success is the journal's to keep (bound
        to the digest of this body, or of ``identity`` where a client may re-send the request
        with a field it draws anew on each try: the request is hashed once); every other
        outcome is stored before a fetch sees it. ``prepare`` decodes the request and the host
        checks it: a refusal is raised (HTTP 400) and still takes the seq, answered as that
        failure to a fetch or a re-send, so the calls numbered after it are not held. What is
        stored is the submission (``CallRecord``), typed, as a restart queues it again.
        ``size``: the request's bytes held while it waits (default: the body's)."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise InvalidArgument(f"seq_id must be an integer >= 1, got {seq!r}")
        request_id = f"{stream}/{seq}"
        digest, body_size = payload(body)
        if identity is not None:
            digest = payload(identity)[0]
        size = size or body_size
        is_a_resend = partial(self._is_a_resend, request_id, stream, seq, digest, size)
        with self._lock:
            if is_a_resend():  # checked first too: a refused or re-sent call is not even decoded
                return request_id
        refusal: Exception | None = None
        try:
            work: Submission | Failed = prepare()
            self.host.check(work.operation, work.request)  # once: its turn does not again
        except USER_ERRORS as error:
            work, refusal = Failed(str(error), "user"), error
        record = _call_record(request_id, seq, work, digest, size)
        with self._lock:
            if is_a_resend():
                return request_id  # a re-send: its ticket already exists
            stored = self._append(record)
            self._queue(record, work, bounded=self._replayed is None)
        if stored is not None:
            self.store.sync(stored)
        if refusal is not None:
            self.results.mark_delivered(request_id)  # the 400 is its answer
            raise refusal
        return request_id

    def _requeue(self, record: CallRecord) -> None:
        """A stored call queued again from its record (inside ``replaying``), as it was
        accepted; raises for a record it cannot take (``replay_failed``)."""
        work = self._submission_of(record)
        stream = stream_of(record.request_id)
        with self._lock:
            if self._is_a_resend(record.request_id, stream, record.seq, record.digest, record.size):
                return
            self._queue(record, work, bounded=False)  # a restart takes back all it accepted

    def _submission_of(self, record: CallRecord) -> Submission | Failed:
        """What ``record`` stored: its submission, or the refusal it was answered with."""
        if record.refused is not None:
            return Failed(record.refused, "user")
        operation = OPERATIONS.get(record.operation)
        if operation is None:
            raise UnreadableCall(f"no operation {record.operation!r} in this version")
        if record.answer not in self.encoders:
            raise UnreadableCall(f"no encoder {record.answer!r} answers it in this version")
        try:
            request = request_of(operation.request_type, record.body)
        except ValueError as error:  # the server's record, not the caller's request
            raise UnreadableCall(str(error)) from None
        return Submission(operation, request, record.answer, record.note, record.run_id)

    def _queue(self, record: CallRecord, work: Submission | Failed, *, bounded: bool) -> None:
        """Queue an accepted call at its number in its stream (under ``_lock``): its
        submission as a command of the host, or a refusal answered at its turn."""
        request_id, stream = record.request_id, stream_of(record.request_id)
        recorded = self._recorded(request_id)
        self.results.add(request_id, record.digest)
        if isinstance(work, Failed):  # it still takes its seq, answered at its turn
            job = self._job(request_id, work)
            self.scheduler.submit(
                stream,
                record.seq,
                record.digest,
                job,
                size=record.size,
                bounded=bounded,
                after_recovery=True,
            )
            return
        command = Command(
            work.operation,
            work.request,
            work.run_id,
            OperationSpec(request_id) if work.operation.keyed else None,
            stream=stream,
            number=record.seq,
            digest=record.digest,
            size=record.size,
            bounded=bounded,
            runs_now=partial(self._runs_at_turn, request_id, recorded),
            applied=partial(self._observed, request_id, work.note),
        )
        ticket = self.host.submit(command)
        ticket.add_done_callback(partial(self._answered, request_id, command, work))

    def _observed(self, request_id: str, note: Any, outcome: Any) -> None:
        """A submission's operation applied: the transport's ``applied`` told, with its note."""
        if note is not None:
            self.applied(request_id, note, outcome)

    def _is_a_resend(self, request_id: str, stream: str, seq: int, digest: str, size: int) -> bool:
        """Whether a call is a re-send (under ``_lock``); raises when it cannot be taken: another
        payload under its key, its stream ended, too much already waiting."""
        self.admit(request_id)
        if self.results.resent(request_id, digest):
            return True
        bounded = self._replayed is None  # a restart takes back all it accepted before
        return not self.scheduler.accepts(stream, seq, digest, size, bounded=bounded)

    def submit_unordered(
        self,
        request_id: str,
        body: dict[str, Any],
        sample: SampleSubmission,
        size: int = 0,
        *,
        run_id: str = "",
    ) -> bool:
        """Queue ``sample`` outside any stream's order as ``request_id``, once the request is
        durable, in run ``run_id``'s turns; False for a re-send (its ticket already exists).
        The same ``request_id`` with another body is refused (``AlreadyExists``). ``size``: the
        bytes the request holds until it has run (default: the body's). It waits within its
        tenant's bound of samples (``account_of``), whatever other tenants send."""
        digest, body_size = payload(body)
        size = size or body_size
        prepare = partial(self._prepare_sample, request_id, self._recorded(request_id), sample)
        account, lane = self.account_of(request_id), self.host.lane_of(run_id)
        with self._lock:
            self.admit(request_id)
            if self.results.resent(request_id, digest):
                return False
            if self._replayed is None:  # a restart takes back all it accepted before
                self.scheduler.check_room(size, account=account)
            ticket = self._append(SampleRecord(request_id, body))
            self.results.add(request_id, digest)
            answer = self.scheduler.run_unordered(
                size=size, prepare=prepare, lane=lane, account=account, after_recovery=True
            )
            answer.add_done_callback(partial(self._sampled, request_id, sample))
        if ticket is not None:
            self.store.sync(ticket)
        return True

    def cancel(self, request_id: str) -> bool:
        """Cancel an unordered request (a sample) not answered yet: its ticket answers a
        ``user`` failure saying so, written durably before anyone can see it, and its work is
        skipped at its turn (or, running, its result discarded). False when it was answered
        already (the answer stands); NotFound-worthy ``KeyError`` for an unknown request."""
        if not self.results.known(request_id):
            raise KeyError(request_id)
        with self._resolving_lock(request_id):
            if not self.results.pending(request_id) or self._being_finished(request_id):
                return False
            at = time.time()
            outcome = Failed(CANCELLED.format(what="nothing of it was returned"), "user")
            outcome = self.store.write_result(request_id, outcome, at)
            self.results.resolve(request_id, outcome, at)
        logger.info("intake: %s cancelled by its client", request_id)
        return True

    def _being_finished(self, request_id: str) -> bool:
        """Whether its result is written and its commit under way (it answers that result)."""
        with self._finished:
            return request_id in self._finishing

    def _resolving_lock(self, request_id: str) -> threading.Lock:
        return self._resolving[hash(request_id) % RESOLVING_LOCKS]

    # -- answering -----------------------------------------------------------------------------

    def _job(self, request_id: str, failure: Failed) -> Callable[[], None]:
        """What answers a request refused when it was accepted, at its turn (once the host
        restored its runs): it takes its seq, so the calls numbered after it run."""
        return partial(self._answer_refusal, request_id, self._recorded(request_id), failure)

    def _answer_refusal(
        self, request_id: str, recorded: ResultRecord | None, failure: Failed
    ) -> None:
        if self._runs_now(request_id, recorded):
            self._finish(request_id, failure, durable=False)

    def _runs_now(self, request_id: str, recorded: ResultRecord | None) -> bool:
        """At a request's turn: whether its work runs, else it is answered already (its
        recorded result, a cancel, its session forgotten, the intake stopped)."""
        if self._stopped:
            return False
        if recorded is not None:
            self.results.resolve(request_id, recorded.outcome, recorded.resolved_at)
            return False
        if not self.results.pending(request_id):
            # Cancelled (or forgotten with its session) before its turn: nothing runs.
            logger.debug("intake: %s not run: answered before its turn", request_id)
            return False
        return True

    def _runs_at_turn(self, request_id: str, recorded: ResultRecord | None) -> bool:
        """``_runs_now``, and its stream's restored run not behind its compacted records (else
        it fails alone: it cannot run exactly once)."""
        if not self._runs_now(request_id, recorded):
            return False
        cannot = self._cannot_replay.get(stream_of(request_id))
        if cannot:
            self._finish(request_id, Failed(cannot, "server"), durable=False)
            return False
        return True

    def _answered(
        self,
        request_id: str,
        command: Command,
        work: Submission,
        ticket: Future[Applied | None],
    ) -> None:
        """A request's ticket resolved, on the engine thread: answered once durable (a keyed
        call's journal entry commits while the next job runs; its response is encoded when it
        is fetched, a read's here, before it is stored)."""
        if ticket.exception() is None and ticket.result() is None:
            return  # it did not run: answered already
        outcome = run_to_outcome(lambda: ticket.result().outcome)
        if isinstance(outcome, Done):
            encode = self.encoders[work.answer]
            respond = partial(encode, work.request, work.note, outcome.body)
            outcome = (
                Done(Deferred(respond)) if command.operation.keyed else run_to_outcome(respond)
            )
        if not command.operation.keyed or not isinstance(outcome, Done):
            self._finish(request_id, outcome, durable=False)  # a read, or a failure: stored
            return
        commit = ticket.result().commit
        if commit is None:  # answered from the journal
            self._finish(request_id, outcome, durable=True)
        else:
            self._started_finishing(request_id)
            commit.add_done_callback(partial(self._journaled, request_id, outcome))

    def _journaled(self, request_id: str, outcome: Outcome, commit: Durable) -> None:
        """On the ledger's commit thread: a keyed call's journal entry is on disk (its result
        with it), or could not be written: then the server fails, as the call's answer says."""
        try:
            wait_durable(commit, request_id)
        except JournalCommitFailed as error:
            failure = self.host.journal_failed(error)
            self._finish(request_id, run_to_outcome(partial(_raise, failure)), durable=False)
        else:
            self._finish(request_id, outcome, durable=True)
        finally:
            self._ended_finishing(request_id)

    def _prepare_sample(
        self, request_id: str, recorded: ResultRecord | None, sample: SampleSubmission
    ) -> PreparedSample | None:
        """A sample's turn, on the engine thread: what it reads (it decodes beside the samples
        queued with it), or None when it is answered already or cannot run."""
        if not self._runs_now(request_id, recorded):
            return None
        prepared = self._run(partial(self._sample_of, sample), request_id)
        if isinstance(prepared, Failed):
            self._finish(request_id, prepared, durable=False)
            return None
        return prepared.body

    def _sample_of(self, sample: SampleSubmission) -> PreparedSample:
        run_id, request = sample.prepare()
        self.host.check(SAMPLE, request)
        return self.host.prepare_sample(run_id, request)

    def _sampled(
        self, request_id: str, sample: SampleSubmission, answer: Future[SampleResult | None]
    ) -> None:
        """A sample's answer (None: nothing ran), encoded on the engine thread and answered once
        durable."""
        if answer.exception() is None and answer.result() is None:
            return
        outcome = run_to_outcome(lambda: sample.encode(answer.result()))
        self._finish(request_id, outcome, durable=False)

    def _run(self, call: Callable[[], Any], request_id: str) -> Outcome:
        cannot = self._cannot_replay.get(stream_of(request_id))
        if cannot:
            return Failed(cannot, "server")
        return run_to_outcome(call)

    def _finish(self, request_id: str, outcome: Outcome, *, durable: bool) -> None:
        """Resolve a ticket, once its outcome is durable: at once when it is already (a keyed
        call's journal entry), else when the result written to the store commits; nothing
        for one cancelled or forgotten meanwhile (nobody asks for it), or once the intake
        stopped (its request stays stored, and the next start runs it again)."""
        at = time.time()
        with self._resolving_lock(request_id):
            if self._stopped or not self.results.pending(request_id):
                return
            if durable:
                self.results.resolve(request_id, outcome, at)
                return
            try:
                ticket = self.store.append(ResultRecord(request_id, outcome, resolved_at=at))
            except (OSError, ResourceExhausted) as error:
                self.results.resolve(request_id, _not_recorded(request_id, error), at)
                return
            self._started_finishing(request_id)
        ticket.committed.add_done_callback(
            lambda _: self._result_committed(request_id, ticket, outcome, at)
        )

    def _result_committed(
        self, request_id: str, ticket: Ticket, outcome: Outcome, at: float
    ) -> None:
        """On the ledger's commit thread: the result is durable (or could not be written: then
        the fetch hears a server error, and a restart runs its call again)."""
        try:
            error = self.store.write_error(ticket)
            if error is not None:
                outcome = _not_recorded(request_id, error)
            with self._resolving_lock(request_id):
                self.results.resolve(request_id, outcome, at)
        finally:  # counted out whatever happened: a stopping intake waits for the count
            self._ended_finishing(request_id)

    def _started_finishing(self, request_id: str) -> None:
        with self._finished:
            self._finishing[request_id] += 1

    def _ended_finishing(self, request_id: str) -> None:
        with self._finished:
            self._finishing[request_id] -= 1
            if not self._finishing[request_id]:
                del self._finishing[request_id]
            self._finished.notify_all()

    def _wait_finished(self) -> None:
        """Until every result written has committed and been answered."""
        with self._finished:
            self._finished.wait_for(lambda: not self._finishing)


def _call_record(
    request_id: str, seq: int, work: Submission | Failed, digest: str, size: int
) -> CallRecord:
    """An accepted call as the store keeps it: typed, or the refusal it is answered with."""
    if isinstance(work, Failed):
        return CallRecord(request_id, seq, "", {}, digest, size, refused=work.error)
    body = request_body(work.request)
    return CallRecord(
        request_id,
        seq,
        work.operation.kind,
        body,
        digest,
        size,
        work.run_id,
        work.answer,
        work.note,
    )


def _raise(error: Exception) -> None:
    raise error


def _not_recorded(request_id: str, error: Exception) -> Failed:
    logger.error("the result of %s was not recorded: %s", request_id, error)
    return Failed(f"the result could not be recorded durably ({error})", "server")

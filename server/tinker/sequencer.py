"""The Tinker front's sequencer: seq_id order, the durable request log and the futures, behind
one ``submit``.

Every training call of the SDK carries ``(model_id, seq_id)``; ``{model_id}/{seq_id}`` is both its
request id and its trainwire operation key, so a re-sent call finds its future (and, after it ran,
the journal's recorded result) instead of running again. Calls run in seq_id order per model
(``SeqOrder``); their results enter the ``FutureStore`` only once durable: a keyed call's journal
commit happens inside the session host before it returns, and every other result (a forward, a
sample, a failure) is written to the ``RequestLog`` first.

Exactly once across a crash: each accepted request is in the log before its request id is handed
out. A restarted front reads the log back (``replaying``) before its listener serves: recorded
results are answered as they are, every other call is submitted again in its original order.
Nothing runs until the host has restored its run (``recovered``); the engine restarted from its
latest checkpoint, so the journal answers the keyed calls before it and the ones since run again,
the same bits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainwire.server.errors import InvalidArgument
from trainwire.server.tinker.futures import (
    USER_ERRORS,
    Done,
    Failed,
    FutureStore,
    Outcome,
    run_to_outcome,
)
from trainwire.server.tinker.ordering import SeqOrder, digest
from trainwire.server.tinker.records import (
    Body,
    CallRecord,
    Record,
    ResultRecord,
    ResumeRecord,
    SampleRecord,
)
from trainwire.server.tinker.request_log import RequestLog, compacted

logger = logging.getLogger(__name__)

Call = Callable[[str], Any]  # a training call's work, given its request id (its operation key)


class Sequencer:
    """Orders, logs and answers the SDK's calls for one front (its files in ``directory``)."""

    def __init__(self, directory: Path) -> None:
        self.futures = FutureStore()
        self.log = RequestLog(directory)
        self.order = SeqOrder(self._when_recovered)
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="tinker-finish")  # in order
        self._lock = threading.Lock()  # orders request records with their submission
        self._recovered = threading.Event()
        self._cannot_replay = ""  # why the restored engine is behind the request log, if it is
        self._replayed: dict[str, Outcome] | None = None  # recorded results, while replaying
        self._resubmitted: set[str] = set()  # request ids submitted again at start, unanswered
        self.resume_position = 0  # the journal position the log was last compacted at

    def stop(self) -> None:
        self.order.stop()
        self._finisher.shutdown()
        self.log.close()

    # -- restart -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def replaying(self) -> Iterator[list[Record]]:
        """The records read back at start; calls submitted meanwhile are not logged again, and
        those with a recorded result are answered with it."""
        records = list(self.log.records)
        self._replayed = {r.request_id: r.outcome for r in records if isinstance(r, ResultRecord)}
        try:
            yield records
        finally:
            self._replayed = None
        if records:
            logger.info("Tinker front: %d request records read back", len(records))

    def resume_at(self, model_id: str, record: ResumeRecord) -> None:
        """A compacted log goes on at ``record``'s seq_id and journal position."""
        self.order.start_model(model_id, record.next_seq)
        self.resume_position = record.position

    def resubmitted(self, request_id: str) -> None:
        self._resubmitted.add(request_id)

    def replay_pending(self) -> bool:
        """Whether a call submitted again at start is unanswered yet (it may create a sampler)."""
        self._resubmitted = {r for r in self._resubmitted if self.futures.pending(r)}
        return self._replayed is not None or bool(self._resubmitted)

    def recovered(self, position: int) -> None:
        """The host restored its run at journal ``position``: submitted calls may run now."""
        if position < self.resume_position:
            self._cannot_replay = (
                f"the engine restored position {position}, before the checkpoint the request log "
                f"was compacted at ({self.resume_position}): this run cannot go on exactly once"
            )
            logger.error("Tinker front: %s", self._cannot_replay)
        self._recovered.set()

    def _when_recovered(self, job: Callable[[], None]) -> None:
        self._recovered.wait()
        job()

    # -- records -------------------------------------------------------------------------------

    def record(self, record: Record) -> None:
        """Write ``record`` durably (not while replaying: it is in the log already)."""
        if self._replayed is None:
            with self._lock:
                self.log.write(record)

    def _append(self, record: Record) -> int | None:
        """Log a request (not while replaying one); its ticket for ``log.sync``."""
        return None if self._replayed is not None else self.log.append(record)

    def compact_at(self, seq_id: int, position: int, head: Callable[[], list[Record]]) -> None:
        """After checkpoint ``seq_id`` (journal ``position``): drop the records a restart no
        longer needs, if every call before it has been answered to the SDK. ``head`` (what the
        front must know first: sessions, samplers) is read while no record can be appended."""

        def choose(records: list[Record]) -> list[Record] | None:
            first = [*head(), ResumeRecord(seq_id, position)]
            return compacted(records, seq_id, self.futures.delivered, first)

        with self._lock:
            self.log.compact(choose)

    def forget_all_but(self, head: Callable[[], list[Record]]) -> None:
        """Keep only ``head`` in the log (the model closed: none of its calls replays again)."""
        with self._lock:
            self.log.compact(lambda _: head())

    # -- submitting ----------------------------------------------------------------------------

    def resolve_now(self, request_id: str, outcome: Outcome) -> None:
        """A request answered as it is made (create_model)."""
        self.futures.add(request_id)
        self.futures.resolve(request_id, outcome)

    def submit(
        self,
        route: str,
        body: Body,
        model_id: str,
        seq_id: Any,
        prepare: Callable[[], Call],
        *,
        encoding: str | None = None,
        keyed: bool = True,
    ) -> str:
        """Queue ``prepare()``'s call as ``seq_id`` of ``model_id``; its request id, once the
        request is durable in the log. A ``keyed`` call's success is the journal's to keep;
        every other outcome is logged before a poll sees it. ``prepare`` checks the request: if
        it refuses it, the refusal is raised (HTTP 400) and still takes the seq_id, answered as
        that failure to a poll or a re-send, so the calls numbered after it are not held."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
            raise InvalidArgument(f"seq_id must be an integer >= 1, got {seq_id!r}")
        request_id = f"{model_id}/{seq_id}"
        recorded = self._replayed.get(request_id) if self._replayed is not None else None
        try:
            call, refusal = prepare(), None
        except USER_ERRORS as error:
            call, refusal = None, error

        def job() -> None:
            if recorded is not None:
                self.futures.resolve(request_id, recorded)
                return
            if call is None:
                self._finish(request_id, Failed(str(refusal), "user"), durable=False)
                return
            outcome = self._run(lambda: call(request_id))
            # Encoding the response (and logging it) happens behind: the next call runs now.
            self._finisher.submit(self._encode_and_finish, request_id, outcome, keyed)

        payload_digest = digest(body)
        with self._lock:
            if not self.order.accepts(model_id, seq_id, payload_digest):
                return request_id  # a re-send: its future already exists
            ticket = self._append(CallRecord(route, request_id, seq_id, body, encoding))
            self.futures.add(request_id)
            self.order.submit(model_id, seq_id, payload_digest, job)
        if ticket is not None:
            self.log.sync(ticket)
        if refusal is not None:
            raise refusal
        return request_id

    def submit_unordered(
        self, request_id: str, body: dict[str, Any], call: Callable[[], Any]
    ) -> bool:
        """Queue ``call`` outside any model's sequence (a sample) as ``request_id``, once the
        request is durable; False for a re-send (its future already exists)."""
        recorded = self._replayed.get(request_id) if self._replayed is not None else None

        def job() -> None:
            if recorded is not None:
                self.futures.resolve(request_id, recorded)
            else:
                self._finish(request_id, self._run(call), durable=False)

        with self._lock:
            if self.futures.known(request_id):
                return False
            if self._replayed is None:  # a restart takes back all it accepted before
                self.order.check_room()
            ticket = self._append(SampleRecord(request_id, body))
            self.futures.add(request_id)
            self.order.run_unordered(job)
        if ticket is not None:
            self.log.sync(ticket)
        return True

    def _run(self, call: Callable[[], Any]) -> Outcome:
        if self._cannot_replay:
            return Failed(self._cannot_replay, "server")
        return run_to_outcome(call)

    def _encode_and_finish(self, request_id: str, outcome: Outcome, keyed: bool) -> None:
        """A call's response, once its engine work is done: ``Done(encode)`` is encoded here."""
        if isinstance(outcome, Done) and callable(outcome.body):
            outcome = run_to_outcome(outcome.body)
        self._finish(request_id, outcome, durable=keyed and isinstance(outcome, Done))

    def _finish(self, request_id: str, outcome: Outcome, *, durable: bool) -> None:
        """Resolve a future, writing its outcome to the log first unless already durable."""
        if not durable:
            outcome = self.log.write_result(request_id, outcome)
        self.futures.resolve(request_id, outcome)

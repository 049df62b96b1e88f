"""The intake's durable memory: every request it accepted and every result a crash could lose.

A client fetches results by the request ids it was given; after a SIGKILL the result store is empty.
So the intake writes each accepted request here and makes it durable before it hands out the
request id, and writes the result of each call the journal does not cover (a ``forward``, a sample,
any failure) before a fetch can see it. A restarted intake reads the records back in order: a
recorded result is final; a call without one is submitted again, and since the engine restarted from
its latest checkpoint, the keyed calls since then run again (the journal answers the ones before
it).

The store is the ledger's ``records`` table (``ledger``: the state directory's one database, WAL,
``synchronous=FULL``): one row per record (``request_records``: its JSON as the record gives it),
in the order written, with the client session it belongs to in a column of its own. Every write
goes through the ledger's writer, so requests written by many threads share a commit with each
other and with the journal entries queued beside them (one fsync); ``sync`` waits for a record's.
A commit is all or nothing, so a crash never leaves half a record. A ledger cut short or damaged
behind the server's back stops it at start (``store_check``: SQLite would open an emptied file as
a new database and forget every request id it answered). Forgetting a client session is one
DELETE of its rows (``forget``). ``compact`` replaces the
records by the ones a restart still needs (``compacted``: the requests since the latest checkpoint,
the samples not yet answered, and the results a client can still ask for, which ``results``'s
retention bounds in time, count and bytes), in one transaction: a crash leaves the old records or
the new.

In memory the store keeps what compaction and the transport ask of its records (ids, seq_ids, a
call's note, small bodies); a heavy body (a ``forward_backward``'s examples, a long prompt, a large
result) stays in its row (``Stored``), and compaction copies that row as it was written, so what a
process holds does not grow with the calls a run sends between two checkpoints.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterable
from concurrent import futures
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from trainwire.server.errors import ResourceExhausted
from trainwire.server.service.ledger import Ledger, ledger_path
from trainwire.server.service.request_records import (
    CallRecord,
    Record,
    ResultRecord,
    SampleRecord,
    owner_of_record,
    record_from_json,
)
from trainwire.server.service.results import Done, Failed, Outcome

logger = logging.getLogger(__name__)

# A record whose JSON is this long keeps its body in its row only: a run that never saves a
# checkpoint would otherwise hold every forward_backward body it was sent in memory until the
# next compaction. Requests' small fields (ids, seq_ids, a load's path) stay in memory.
HEAVY_RECORD_BYTES = 4096
RECORD_LABEL = "record"  # how the ledger's log names a record's write (``record <kind>``)
INSERT = "INSERT INTO records (place, kind, owner, record) VALUES (?, ?, ?, ?)"


@dataclass(frozen=True)
class Stored:
    """A body left in the store: its record is the row at ``place``. Only ``RequestStore``
    reads it back (``calls``, ``compact`` copies the row as it was written)."""

    place: int


@dataclass(frozen=True)
class Ticket:
    """An appended record's row and its commit (``RequestStore.sync`` waits for it)."""

    place: int
    committed: futures.Future[Any]


def stream_of(request_id: str) -> str:
    """The stream (a Tinker model, a sampling session) a request id ``{stream}/{seq}`` is of."""
    return request_id.rpartition("/")[0]


def compacted(
    records: list[Record],
    stream: str,
    seq_id: int,
    settled: Callable[[str], bool],
    head: list[Record],
    carry: Callable[[list[str]], list[ResultRecord]] | None = None,
    ordered: Callable[[str], bool] | None = None,
) -> list[Record] | None:
    """The records to keep after a checkpoint of ``stream`` at ``seq_id``: ``head`` (sessions,
    notes, where each stream resumes), the results ``carry`` keeps of the requests whose
    records go, the stream's calls from ``seq_id`` on, every other ordered stream's requests as
    they are (each is compacted at its own checkpoints), and the samples not ``settled`` yet,
    with their results.

    ``settled(request_id)``: the request needs its record no more (answered, or its result
    carried). None while a call of ``stream`` before the checkpoint is not: it may still be
    asked for. ``ordered(name)``: whether ``name`` is a stream whose calls are kept until its
    own checkpoint (default: ``stream`` only); a result of any other stream (a sample's, a
    closed model's) is carried or not by retention. ``carry`` is given the request ids whose
    records go, in log order (none: nothing carried).
    """
    ordered = ordered or (lambda name: name == stream)
    calls = [r for r in records if isinstance(r, CallRecord) and stream_of(r.request_id) == stream]
    before = [r.request_id for r in calls if r.seq < seq_id]
    if not before or not all(settled(request_id) for request_id in before):
        return None

    def goes(request_id: str) -> bool:
        of = stream_of(request_id)
        if of == stream:
            return _seq_of(request_id) < seq_id
        return not ordered(of) and settled(request_id)

    requests = [r for r in records if isinstance(r, CallRecord | SampleRecord | ResultRecord)]
    gone = [r.request_id for r in requests if goes(r.request_id)]
    carried = carry(list(dict.fromkeys(gone))) if carry is not None else []
    gone_ids = set(gone)
    return head + carried + [r for r in requests if r.request_id not in gone_ids]


def _seq_of(request_id: str) -> int:
    """The number of a request id ``{stream}/{seq}`` (-1 for one that carries none)."""
    seq = request_id.rpartition("/")[2]
    return int(seq) if seq.isdigit() else -1


class RequestStore:
    """The records of one intake, in ``ledger``; ``owner_of`` gives the client session of a
    request id (``request_records.owner_of_record``).

    Thread-safe: appends from many threads share their commits (``sync``)."""

    def __init__(self, ledger: Ledger, owner_of: Callable[[str], str]) -> None:
        self.ledger = ledger
        self.path = ledger.path
        self.owner_of = owner_of
        # The records in memory, and the order appends are queued in (a row's place is its
        # rank: records come back in the order written).
        self._lock = threading.Lock()
        rows = ledger.read(
            lambda db: db.execute("SELECT place, record FROM records ORDER BY place").fetchall()
        )
        self._records: list[Record] = [_record(text, place) for place, text in rows]
        self._places: list[int] = [place for place, _ in rows]  # each record's row
        self._next_place = self._places[-1] + 1 if self._places else 1
        # Appended records whose commit nobody has seen through yet, by place: one that fails
        # leaves memory too (``_settle``).
        self._unsettled: dict[int, futures.Future[Any]] = {}

    # -- reading -------------------------------------------------------------------------------

    @property
    def records(self) -> list[Record]:
        """The records in the order written (heavy bodies ``Stored``), none whose write failed."""
        with self._lock:
            self._settle()
            return list(self._records)

    def leave_bodies_on_disk(self) -> None:
        """Once the records read at start were taken back (they needed their bodies), keep the
        heavy ones' bodies in their rows only, as ``append`` does for new ones."""
        with self._lock:
            self._wait_for_writes()
            lengths = dict(
                self.ledger.read(
                    lambda db: db.execute("SELECT place, length(record) FROM records").fetchall()
                )
            )
            self._records = [
                _light(record, place, lengths.get(place, 0))
                for record, place in zip(self._records, self._places, strict=True)
            ]

    def calls(self, operations: Collection[str]) -> tuple[list[CallRecord], set[str]]:
        """The stored calls of the kinds ``operations`` (their notes whole: only a body may be
        left in its row), and the request ids whose result is recorded; as of one moment (no
        append or compaction meanwhile)."""
        with self._lock:
            self._settle()
            records = self._records
            calls = [r for r in records if isinstance(r, CallRecord) and r.operation in operations]
            answered = {r.request_id for r in records if isinstance(r, ResultRecord)}
        return calls, answered

    # -- writing -------------------------------------------------------------------------------

    def append(self, record: Record) -> Ticket:
        """Queue ``record`` for the ledger's next commit (durable once ``sync`` is given the
        returned ticket)."""
        kind, owner, text = self._row(record)
        with self._lock:
            place = self._next_place
            self._next_place += 1
            label = f"{RECORD_LABEL} {kind}"
            written = self.ledger.write(partial(_insert, place, kind, owner, text), label)
            self._records.append(_light(record, place, len(text)))
            self._places.append(place)
            self._unsettled[place] = written
            if len(self._unsettled) > SETTLE_AFTER:  # written and never synced: results
                self._settle()
        return Ticket(place, written)

    def write_error(self, ticket: Ticket) -> Exception | None:
        """Once ``ticket``'s commit is done: why its record was not stored (None: it was), as
        ``sync`` raises it; takes no lock, so the ledger's commit thread may ask (the record
        leaves memory at the next ``append`` past ``SETTLE_AFTER`` or compaction)."""
        error = ticket.committed.exception()
        return _refusal(error) if isinstance(error, sqlite3.Error) else error

    def sync(self, ticket: Ticket) -> None:
        """Return once the record of ``ticket`` is durable (one commit may cover many);
        ResourceExhausted (or the disk's error) when its write failed: then it is not stored,
        and leaves memory too."""
        try:
            ticket.committed.result()
        except sqlite3.Error as error:
            with self._lock:
                self._settle()
            raise _refusal(error) from None
        with self._lock:
            self._unsettled.pop(ticket.place, None)

    def _settle(self) -> None:
        """Drop the records whose write failed from memory (under ``_lock``)."""
        done = [place for place, written in self._unsettled.items() if written.done()]
        failed = {place for place in done if self._unsettled[place].exception() is not None}
        for place in done:
            del self._unsettled[place]
        if failed:
            kept = [
                (record, place)
                for record, place in zip(self._records, self._places, strict=True)
                if place not in failed
            ]
            self._records = [record for record, _ in kept]
            self._places = [place for _, place in kept]

    def _wait_for_writes(self) -> None:
        """Every append so far committed or failed, and settled (under ``_lock``)."""
        futures.wait(list(self._unsettled.values()))
        self._settle()

    def write(self, record: Record) -> None:
        """``append`` and ``sync``: the record is durable when this returns."""
        self.sync(self.append(record))

    def write_result(self, request_id: str, outcome: Outcome, at: float | None = None) -> Outcome:
        """Write a result (resolved ``at``) durably; what a fetch may then see: the outcome, or a
        server error if it could not be written (a restart runs its call again)."""
        try:
            self.write(ResultRecord(request_id, outcome, resolved_at=at))
        except (OSError, ResourceExhausted) as error:
            logger.error("the result of %s was not recorded: %s", request_id, error)
            return Failed(f"the result could not be recorded durably ({error})", "server")
        return outcome

    def forget(self, owners: Iterable[str]) -> None:
        """Delete every record of the client sessions ``owners``, durably."""
        owners = sorted(set(owners))
        if not owners:
            return
        marks = ",".join("?" * len(owners))
        with self._lock:
            self._wait_for_writes()
            try:
                self.ledger.write_now(
                    lambda db: db.execute(f"DELETE FROM records WHERE owner IN ({marks})", owners)
                )
            except sqlite3.Error as error:
                raise _refusal(error) from None
            kept = [
                (record, place)
                for record, place in zip(self._records, self._places, strict=True)
                if owner_of_record(record, self.owner_of) not in owners
            ]
            self._records = [record for record, _ in kept]
            self._places = [place for _, place in kept]

    def compact(self, choose: Callable[[list[Record]], list[Record] | None]) -> bool:
        """Replace the records by ``choose(records)`` (None: keep them as they are), durably and
        atomically: a crash leaves the old records or the new. No record is appended meanwhile,
        so none is lost between choosing and replacing. True when they were replaced.

        The records ``choose`` keeps in their order at its end (the requests a restart still
        needs) keep their rows: the others are DELETEd. What comes before them (a head of
        sessions, notes, where streams resume, carried results) is written below every row, a
        kept record's row copied as it was written (its body is never decoded)."""
        with self._lock:
            self._wait_for_writes()
            kept = choose(list(self._records))
            if kept is None:
                return False
            place_of = {id(r): p for r, p in zip(self._records, self._places, strict=True)}
            staying = _staying(kept, place_of)
            head = kept[: len(kept) - len(staying)]
            lowest = min(self._places, default=self._next_place)
            head_places = list(range(lowest - len(head), lowest))
            rows = [
                (place, self._row(record) if id(record) not in place_of else place_of[id(record)])
                for record, place in zip(head, head_places, strict=True)
            ]
            gone = sorted(set(self._places) - {place_of[id(r)] for r in staying})
            try:
                lengths = self.ledger.write_now(partial(_compact_rows, rows, gone))
            except sqlite3.Error as error:
                raise _refusal(error) from None
            self._records = [
                *(_light(r, p, lengths[p]) for r, p in zip(head, head_places, strict=True)),
                *staying,
            ]
            self._places = [*head_places, *(place_of[id(r)] for r in staying)]
        logger.debug("%s compacted to %d records", self.path, len(kept))
        return True

    def _row(self, record: Record) -> tuple[str, str | None, str]:
        """``record``'s row: its kind, its client session, its JSON."""
        fields = record.to_json()
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return str(fields["kind"]), owner_of_record(record, self.owner_of), text

    def close(self) -> None:
        """Wait for the records appended so far (the ledger, the host's, stays open)."""
        with self._lock:
            self._wait_for_writes()


def _insert(place: int, kind: str, owner: str | None, text: str, db: sqlite3.Connection) -> None:
    db.execute(INSERT, (place, kind, owner, text))


def _staying(kept: list[Record], place_of: dict[int, int]) -> list[Record]:
    """The longest run at the end of ``kept`` of stored records in their stored order: they keep
    their rows."""
    staying: list[Record] = []
    for record in reversed(kept):
        place = place_of.get(id(record))
        if place is None or (staying and place >= place_of[id(staying[-1])]):
            break
        staying.append(record)
    return staying[::-1]


def _compact_rows(
    head: list[tuple[int, int | tuple[str, str | None, str]]],
    gone: list[int],
    db: sqlite3.Connection,
) -> dict[int, int]:
    """Write ``head`` (each a new place and the old place whose row it copies, or a new row),
    then DELETE the rows at ``gone``; the length of each head row."""
    for place, row in head:
        if isinstance(row, int):
            db.execute(
                "INSERT INTO records (place, kind, owner, record) "
                "SELECT ?, kind, owner, record FROM records WHERE place = ?",
                (place, row),
            )
        else:
            db.execute(INSERT, (place, *row))
    db.executemany("DELETE FROM records WHERE place = ?", [(place,) for place in gone])
    places = [place for place, _ in head]
    marks = ",".join("?" * len(places))
    query = f"SELECT place, length(record) FROM records WHERE place IN ({marks})"
    return dict(db.execute(query, places).fetchall())


def read_records(state_dir: Path) -> list[Record]:
    """The records stored in ``state_dir``'s ledger as they stand on disk, bodies whole (for
    ``trainwire`` tools and tests; a running server may be writing meanwhile)."""
    path = ledger_path(state_dir)
    if not path.is_file():
        return []
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT record FROM records ORDER BY place").fetchall()
    finally:
        db.close()
    return [record_from_json(json.loads(text)) for (text,) in rows]


# Writes not synced by their writer (results, answered from the commit thread) are settled in
# memory once this many are outstanding.
SETTLE_AFTER = 256


def _refusal(error: sqlite3.Error) -> Exception:
    """A ledger error as the caller's answer: the request is not accepted."""
    if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return ResourceExhausted("the disk is full: the request is not accepted")
    return ResourceExhausted(f"the request could not be stored durably ({error}): not accepted")


def _record(text: str, place: int) -> Record:
    """A stored row back as its record (whole: a restart takes every body back)."""
    try:
        return record_from_json(json.loads(text))
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"request store: record at row {place} is corrupt") from None


def _light(record: Record, place: int, length: int) -> Record:
    """``record`` as the store keeps it in memory: a heavy record's body left in its row."""
    if length < HEAVY_RECORD_BYTES:
        return record
    stored = Stored(place)
    if isinstance(record, CallRecord | SampleRecord):
        return replace(record, body=stored)  # type: ignore[arg-type]
    if isinstance(record, ResultRecord) and isinstance(record.outcome, Done):
        return replace(record, outcome=Done(stored))  # type: ignore[arg-type]
    return record

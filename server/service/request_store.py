"""The intake's durable memory: every request it accepted and every result a crash could lose.

A client fetches results by the request ids it was given; after a SIGKILL the result store is empty.
So the intake writes each accepted request here and makes it durable before it hands out the
request id, and writes the result of each call the journal does not cover (a ``forward``, a sample,
any failure) before a fetch can see it. A restarted intake reads the records back in order: a
recorded result is final; a call without one is submitted again, and since the engine restarted from
its latest checkpoint, the keyed calls since then run again (the journal answers the ones before
it).

The store is SQLite, kept as the journal is kept (WAL, ``synchronous=FULL``): one row per record
(``request_records``: its JSON as the record gives it), in the order written, with the client
session it belongs to in a column of its own. A commit is all or nothing, so a crash never leaves
half a record; requests written by many threads share one commit (``sync``), so they share one
fsync. A store cut short or damaged behind the server's back stops it at start (``store_check``:
SQLite would open an emptied file as a new store and forget every request id it answered).
Forgetting a client session is one DELETE of its rows (``forget``). ``compact`` replaces the
records by the ones a restart still needs (``compacted``: the requests since the latest checkpoint,
the samples not yet answered, and the results a client can still ask for, which ``results``'s
retention bounds in time, count and bytes), in one transaction: a crash leaves the old records or
the new.

In memory the store keeps what compaction and the routes ask of its records (ids, seq_ids, small
bodies); a heavy body (a ``forward_backward``'s protobuf, a long prompt, a large result) stays in
its row (``Stored``), and compaction copies that row as it was written, so what a process holds does
not grow with the calls a run sends between two checkpoints.

A state directory written by an earlier version holds the same records as lines of JSON
(``requests.jsonl``); the first start reads them in (``_take_in_the_legacy_log``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from trainwire.server.errors import ResourceExhausted
from trainwire.server.service.request_records import (
    CallRecord,
    Record,
    ResultRecord,
    SampleRecord,
    owner_of_record,
    record_from_json,
)
from trainwire.server.service.results import Done, Failed, Outcome
from trainwire.server.service.store_check import check_store, mark_created

logger = logging.getLogger(__name__)

STORE_FILE = "requests.sqlite3"
LEGACY_LOG_FILE = "requests.jsonl"  # the line-per-record log of earlier versions
# A record whose JSON is this long keeps its body in its row only: a run that never saves a
# checkpoint would otherwise hold every forward_backward body it was sent in memory until the
# next compaction. Requests' small fields (ids, seq_ids, a load's path) stay in memory.
HEAVY_RECORD_BYTES = 4096
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    place      INTEGER PRIMARY KEY AUTOINCREMENT,
    kind       TEXT NOT NULL,
    owner      TEXT,
    record     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS records_by_owner ON records (owner);
"""
INSERT = "INSERT INTO records (kind, owner, record) VALUES (?, ?, ?)"


@dataclass(frozen=True)
class Stored:
    """A body left in the store: its record is the row at ``place``. Only ``RequestStore``
    reads it back (``calls``, ``compact`` copies the row as it was written)."""

    place: int


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
    """The records of one intake, in ``directory/requests.sqlite3``; ``owner_of`` gives the
    client session of a request id (``request_records.owner_of_record``).

    Thread-safe: appends from many threads share their commits (``sync``)."""

    def __init__(self, directory: Path, owner_of: Callable[[str], str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / STORE_FILE
        check_store(
            self.path,
            what="the request store",
            table="records",
            afresh="start its front afresh, losing the requests and results it held",
        )
        self.owner_of = owner_of
        self._lock = threading.Lock()  # the connection and the records in memory
        self._sync_lock = threading.Lock()  # one commit at a time; a waiter may find it done
        # isolation_level=None: no implicit transactions; appends open one, ``sync`` commits it.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        mark_created(self.path)  # from here on, the store missing or empty is damage
        self._written = 0  # records appended (the tickets handed out)
        self._synced = 0  # tickets settled: committed, or lost with a failed commit
        self._lost: list[tuple[int, int]] = []  # ticket ranges (after, through) a commit lost
        self.records: list[Record] = []  # in the order written; heavy bodies ``Stored``
        self._places: list[int] = []  # each record's row
        self._take_in_the_legacy_log(directory / LEGACY_LOG_FILE)
        for place, text in self._db.execute("SELECT place, record FROM records ORDER BY place"):
            self.records.append(_record(text, place))
            self._places.append(place)

    # -- reading -------------------------------------------------------------------------------

    def leave_bodies_on_disk(self) -> None:
        """Once the records read at start were taken back (they needed their bodies), keep the
        heavy ones' bodies in their rows only, as ``append`` does for new ones."""
        with self._lock:
            rows = self._db.execute("SELECT place, length(record) FROM records").fetchall()
            lengths = dict(rows)
            self.records = [
                _light(record, place, lengths.get(place, 0))
                for record, place in zip(self.records, self._places, strict=True)
            ]

    def calls(self, route: str) -> tuple[list[CallRecord], set[str]]:
        """The stored calls of ``route`` whole (a body left in its row read back), and the
        request ids whose result is recorded; as of one moment (no append or compaction
        meanwhile)."""
        with self._lock:
            calls = [r for r in self.records if isinstance(r, CallRecord) and r.route == route]
            answered = {r.request_id for r in self.records if isinstance(r, ResultRecord)}
            whole = [self._whole(call) for call in calls]
        return whole, answered

    def _whole(self, call: CallRecord) -> CallRecord:
        if not isinstance(call.body, Stored):
            return call
        (text,) = self._db.execute(
            "SELECT record FROM records WHERE place = ?", (call.body.place,)
        ).fetchone()
        record = record_from_json(json.loads(text))
        assert isinstance(record, CallRecord) and record.request_id == call.request_id
        return record

    # -- writing -------------------------------------------------------------------------------

    def append(self, record: Record) -> int:
        """Write ``record`` (durable once ``sync`` is given the returned ticket)."""
        row = self._row(record)
        with self._lock:
            if not self._db.in_transaction:
                self._db.execute("BEGIN")
            self._db.execute("SAVEPOINT record")
            try:
                cursor = self._db.execute(INSERT, row)
            except sqlite3.Error as error:
                self._undo_the_failed_insert()
                raise _refusal(error) from None
            self._db.execute("RELEASE record")
            place = int(cursor.lastrowid or 0)
            self.records.append(_light(record, place, len(row[2])))
            self._places.append(place)
            self._written += 1
            return self._written

    def _undo_the_failed_insert(self) -> None:
        """After an INSERT failed: no half record. SQLite may have rolled the whole transaction
        back (a full disk can): then the records appended since the last commit are lost too,
        and their tickets say so when synced."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK TO record")
            self._db.execute("RELEASE record")
            return
        self._lose_pending()

    def _lose_pending(self) -> None:
        """The records appended since the last commit are not stored (under ``_lock``)."""
        after, through = self._synced, self._written
        if through > after:
            count = len(self.records) - (through - after)
            del self.records[count:], self._places[count:]
            self._lost.append((after, through))
        self._synced = through

    def sync(self, ticket: int) -> None:
        """Return once the record with ``ticket`` is durable (one commit may cover many);
        ResourceExhausted (or the disk's error) when its commit failed: then it is not stored."""
        with self._sync_lock:
            if self._synced < ticket:
                self._commit()
            if any(after < ticket <= through for after, through in self._lost):
                raise ResourceExhausted("the request could not be stored durably: not accepted")

    def _commit(self) -> None:
        with self._lock:
            self._commit_pending()

    def _commit_pending(self) -> None:
        """Commit what was appended and not yet committed (under ``_lock``): on a failure those
        records are gone, from the store and from memory, and their tickets say so."""
        try:
            if self._db.in_transaction:
                self._db.execute("COMMIT")
        except sqlite3.Error as error:
            logger.error("%s: records not stored: %s", self.path, error)
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            self._lose_pending()
        self._synced = self._written

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
        with self._sync_lock, self._lock:
            self._commit_pending()
            marks = ",".join("?" * len(owners))
            self._transaction([(f"DELETE FROM records WHERE owner IN ({marks})", owners)])
            kept = [
                (record, place)
                for record, place in zip(self.records, self._places, strict=True)
                if owner_of_record(record, self.owner_of) not in owners
            ]
            self.records = [record for record, _ in kept]
            self._places = [place for _, place in kept]

    def compact(self, choose: Callable[[list[Record]], list[Record] | None]) -> bool:
        """Replace the records by ``choose(records)`` (None: keep them as they are), durably and
        atomically: a crash leaves the old records or the new. No record is appended meanwhile,
        so none is lost between choosing and replacing. A kept record's row is copied as it was
        written (its body is never decoded). True when they were replaced."""
        with self._sync_lock, self._lock:
            self._commit_pending()
            kept = choose(list(self.records))
            if kept is None:
                return False
            place_of = {id(r): p for r, p in zip(self.records, self._places, strict=True)}
            last = self._places[-1] if self._places else 0
            self._db.execute("BEGIN")
            try:
                places = []
                for record in kept:
                    old = place_of.get(id(record))
                    if old is None:
                        cursor = self._db.execute(INSERT, self._row(record))
                    else:
                        cursor = self._db.execute(
                            "INSERT INTO records (kind, owner, record) "
                            "SELECT kind, owner, record FROM records WHERE place = ?",
                            (old,),
                        )
                    places.append(int(cursor.lastrowid or 0))
                self._db.execute("DELETE FROM records WHERE place <= ?", (last,))
                self._db.execute("COMMIT")
            except sqlite3.Error as error:
                self._db.execute("ROLLBACK")
                raise _refusal(error) from None
            lengths = dict(self._db.execute("SELECT place, length(record) FROM records"))
            self.records = [
                _light(record, place, lengths[place])
                for record, place in zip(kept, places, strict=True)
            ]
            self._places = places
        logger.debug("%s compacted to %d records", self.path, len(kept))
        return True

    def _transaction(self, statements: list[tuple[str, list[str]]]) -> None:
        self._db.execute("BEGIN")
        try:
            for statement, parameters in statements:
                self._db.execute(statement, parameters)
            self._db.execute("COMMIT")
        except sqlite3.Error as error:
            self._db.execute("ROLLBACK")
            raise _refusal(error) from None

    def _row(self, record: Record) -> tuple[str, str | None, str]:
        """``record``'s row: its kind, its client session, its JSON."""
        fields = record.to_json()
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return str(fields["kind"]), owner_of_record(record, self.owner_of), text

    def close(self) -> None:
        with self._sync_lock:
            self._commit()
            with self._lock:
                self._db.close()

    # -- an earlier version's log --------------------------------------------------------------

    def _take_in_the_legacy_log(self, path: Path) -> None:
        """Read an earlier version's line-per-record log into the store, in one transaction,
        then remove it. Its last line torn by a crash (never durable, never answered) is dropped;
        a corrupt line before it is an error, never a silent loss. The sessions it says were
        forgotten (``"kind": "forgotten"``) leave with their records."""
        if not path.is_file():
            return
        has_rows = self._db.execute("SELECT 1 FROM records LIMIT 1").fetchone() is not None
        if not has_rows:  # else it was read in before a crash kept it from being removed
            records, forgotten = _read_legacy_log(path)
            kept = [r for r in records if owner_of_record(r, self.owner_of) not in forgotten]
            self._db.execute("BEGIN")
            for record in kept:
                self._db.execute(INSERT, self._row(record))
            self._db.execute("COMMIT")
            logger.info("%s: %d records read in from %s", self.path, len(kept), path.name)
        path.unlink()


def read_records(directory: Path) -> list[Record]:
    """The records stored in ``directory`` as they stand on disk, bodies whole (for ``trainwire``
    tools and tests; a running intake may be writing meanwhile)."""
    path = directory / STORE_FILE
    if not path.is_file():
        return []
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT record FROM records ORDER BY place").fetchall()
    finally:
        db.close()
    return [record_from_json(json.loads(text)) for (text,) in rows]


def _read_legacy_log(path: Path) -> tuple[list[Record], set[str]]:
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        logger.warning("%s: dropped a torn last record", path)
    records: list[Record] = []
    forgotten: set[str] = set()
    for number, line in enumerate(data[:complete].splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            if fields.get("kind") == "forgotten":
                forgotten.update(fields["session_ids"])
            else:
                records.append(record_from_json(fields))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{path}: record {number} is corrupt") from None
    return records, forgotten


def _refusal(error: sqlite3.Error) -> Exception:
    """A store error as the caller's answer: a full disk refuses the request."""
    if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return ResourceExhausted("the disk is full: the request is not accepted")
    return OSError(f"the request store failed: {error}")


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

"""The durable operation journal: which operation keys a run has applied, and what they returned.

One SQLite database per run, in WAL mode with ``synchronous=FULL``: a committed entry survives a
power cut. ``commit_async`` queues an entry for the journal's own thread, which commits what is
queued together in one transaction (group commit), and its Future completes once the entry is on
disk; ``commit`` waits for that. The active run looks a key up before
running anything (same payload → the journaled result; other payload → ALREADY_EXISTS) and commits
each applied operation with its position. An entry's ``result`` is the operation's outcome in the
JSON form ``outcome_record`` gives it; ``outcome_from_record`` reads it back. An entry's ``kind``
is its operation's (``operations.OPERATIONS``); the journal stores it and never interprets it.

A journal cut short or damaged behind the server's back is never opened as a new, empty one
(``store_check``): the run's restore fails with the reason, instead of answering every key as
never applied.

A restart rolls the session back to its latest checkpoint; the entries after it are marked
``rolled_back`` rather than deleted, so their keys run again when the controller replays them (the
new run replaces the rolled-back row) while the log of what happened stays readable.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from trainwire.contract.config import canonical_json, sha256_fingerprint
from trainwire.contract.outcomes import ExportedFile, OperationOutcome
from trainwire.server.errors import InvalidArgument
from trainwire.server.service.store_check import check_store, mark_created

JOURNAL_FILE = "journal.sqlite3"
MAX_KEY_CHARS = 1024
SCHEMA_VERSION = 1
OutcomeT = TypeVar("OutcomeT", bound=OperationOutcome)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
    operation_key  TEXT PRIMARY KEY,
    kind           TEXT NOT NULL,
    payload_sha256 TEXT NOT NULL,
    position       INTEGER NOT NULL,
    result         TEXT NOT NULL,
    rolled_back    INTEGER NOT NULL DEFAULT 0,
    recorded_at    REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS operations_by_position ON operations (position);
"""


def check_journal(path: Path) -> None:
    """``DamagedStore`` naming the journal at ``path`` (in its run's folder) and what to do,
    when the state directory created it and it is now missing, empty or damaged."""
    check_store(
        path,
        what=f"run {path.parent.name!r}'s journal",
        table="operations",
        afresh="restore that run with no record of the keys it applied (a re-sent key runs again)",
    )


@dataclass(frozen=True)
class JournalEntry:
    """One applied operation: its key, what it was, where it landed and what it returned."""

    operation_key: str
    kind: str
    payload_sha256: str
    position: int
    result: dict[str, Any]
    rolled_back: bool = False
    recorded_at: float = 0.0


class Journal:
    """The journal of one run, at ``path`` (created on first use).

    Thread-safe; the host serializes operations anyway, so contention is nil.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_journal(self.path)
        self._lock = threading.Lock()  # the writing connection
        # isolation_level=None: no implicit transactions; each write is one explicit transaction.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        mark_created(self.path)  # from here on, the journal missing or empty is damage
        # Lookups read through their own connection, so a commit's fsync never holds them up.
        self._read_lock = threading.Lock()
        self._reader = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._state = threading.Lock()  # the pending entries, the failure, the committer
        self._pending: dict[str, tuple[JournalEntry, futures.Future[None]]] = {}
        self._queue: queue.SimpleQueue[tuple[JournalEntry, futures.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._failure: BaseException | None = None
        self._committer: threading.Thread | None = None

    def close(self) -> None:
        """Finish the queued commits, then close (an entry queued before is durable after)."""
        with self._state:
            committer, self._committer = self._committer, None
        if committer is not None:
            self._queue.put(None)
            committer.join()
        with self._lock, self._read_lock:
            self._reader.close()
            self._db.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lookup(self, operation_key: str) -> JournalEntry | None:
        """The live (not rolled back) entry for ``operation_key``, or None; an entry queued for
        its commit counts (``durable`` says when it is on disk)."""
        with self._state:
            pending = self._pending.get(operation_key)
        if pending is not None:
            return pending[0]
        with self._read_lock:
            row = self._reader.execute(
                "SELECT * FROM operations WHERE operation_key = ? AND rolled_back = 0",
                (operation_key,),
            ).fetchone()
        return None if row is None else _entry(row)

    def durable(self, operation_key: str) -> futures.Future[None] | None:
        """The commit of ``operation_key``'s entry while it is queued; None once it is on disk."""
        with self._state:
            pending = self._pending.get(operation_key)
        return None if pending is None else pending[1]

    def wait_all_durable(self) -> None:
        """Return once every entry queued so far is on disk; raise the commit's error if one of
        them failed (or an earlier commit did: the journal stops where the disk stopped)."""
        with self._state:
            failure = self._failure
            pending = [future for _, future in self._pending.values()]
        if failure is not None:
            raise RuntimeError(f"an earlier commit failed: {failure}")
        for future in pending:
            future.result()

    def commit(self, entry: JournalEntry) -> None:
        """Commit ``entry`` durably before returning (see ``commit_async``)."""
        self.commit_async(entry).result()

    def commit_async(self, entry: JournalEntry) -> futures.Future[None]:
        """Queue ``entry`` for a durable commit; the Future completes once it is on disk.

        Entries commit in the order queued, those queued together in one transaction (one
        fsync: group commit), each replacing a rolled-back entry of its key. ``lookup`` sees it
        at once. After a failed commit every later one fails too: the journal stops where the
        disk stopped, and only a restart makes journal and engine agree again.
        """
        future: futures.Future[None] = futures.Future()
        with self._state:
            if self._failure is not None:
                future.set_exception(RuntimeError(f"an earlier commit failed: {self._failure}"))
                return future
            self._pending[entry.operation_key] = (entry, future)
            if self._committer is None:
                self._committer = threading.Thread(
                    target=self._commit_queued, name="trainwire-journal", daemon=True
                )
                self._committer.start()
        self._queue.put((entry, future))
        return future

    def _commit_queued(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stop = [first], False
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._write_batch(batch)
            if stop:
                return

    def _write_batch(self, batch: list[tuple[JournalEntry, futures.Future[None]]]) -> None:
        try:
            with self._lock:
                self._write([entry for entry, _ in batch])
        except BaseException as error:
            with self._state:
                self._failure = error
                for entry, _ in batch:
                    self._pending.pop(entry.operation_key, None)
            for _, future in batch:
                future.set_exception(error)
            return
        with self._state:
            for entry, _ in batch:
                self._pending.pop(entry.operation_key, None)
        for _, future in batch:
            future.set_result(None)

    def _write(self, entries: list[JournalEntry]) -> None:
        """One transaction for ``entries``; raises ``sqlite3.IntegrityError`` if a live entry
        holds one of their keys (the host never asks)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for entry in entries:
                self._db.execute(
                    "DELETE FROM operations WHERE operation_key = ? AND rolled_back = 1",
                    (entry.operation_key,),
                )
                self._db.execute(
                    "INSERT INTO operations VALUES (?, ?, ?, ?, ?, 0, ?)",
                    (
                        entry.operation_key,
                        entry.kind,
                        entry.payload_sha256,
                        entry.position,
                        json.dumps(entry.result, sort_keys=True),
                        entry.recorded_at or time.time(),
                    ),
                )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def roll_back_after(self, position: int) -> int:
        """Mark every live entry past ``position`` rolled back; returns how many."""
        with self._lock:
            cursor = self._db.execute(
                "UPDATE operations SET rolled_back = 1 WHERE position > ? AND rolled_back = 0",
                (position,),
            )
            return cursor.rowcount

    def roll_back_others_at(self, position: int, operation_key: str) -> int:
        """Mark live entries at ``position`` under another key rolled back; returns how many.
        One position holds one operation: the checkpoint recovery restores says which."""
        with self._lock:
            cursor = self._db.execute(
                "UPDATE operations SET rolled_back = 1 "
                "WHERE position = ? AND operation_key != ? AND rolled_back = 0",
                (position, operation_key),
            )
            return cursor.rowcount

    def entries(self, *, include_rolled_back: bool = False) -> list[JournalEntry]:
        """Entries in position order (rolled-back ones after live ones at the same position)."""
        where = "" if include_rolled_back else "WHERE rolled_back = 0"
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM operations {where} ORDER BY position, rolled_back, recorded_at"
            ).fetchall()
        return [_entry(row) for row in rows]

    def last(self) -> JournalEntry | None:
        """The live entry with the highest position, or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM operations WHERE rolled_back = 0 ORDER BY position DESC LIMIT 1"
            ).fetchone()
        return None if row is None else _entry(row)


def _entry(row: tuple[Any, ...]) -> JournalEntry:
    key, kind, payload, position, result, rolled_back, recorded_at = row
    return JournalEntry(
        key, kind, payload, position, json.loads(result), bool(rolled_back), recorded_at
    )


def payload_digest(kind: str, payload: dict[str, Any]) -> str:
    """What a reused key is compared by: the operation kind and its payload, never its Operation."""
    return sha256_fingerprint(canonical_json({"kind": kind, "payload": payload}))


@dataclass(frozen=True)
class KeyDigest:
    """What an operation key is bound to in the journal: ``value``.

    A request the intake accepted is bound to the digest of its body as it was received (the
    intake hashes every request it takes, so a request is hashed once: ``request:<hex>``); a
    gRPC request to its operation's payload (``payload_digest``). ``earlier`` gives the payload
    digest that an earlier version journaled for an intake's request, compared only when
    ``value`` does not match, so a journal written before still answers its keys.
    """

    value: str
    earlier: Callable[[], str] | None = None

    def matches(self, recorded: str) -> bool:
        return recorded == self.value or (self.earlier is not None and recorded == self.earlier())


def request_digest(body_digest: str) -> str:
    """The journal's form of the digest the intake took of a request's body."""
    return f"request:{body_digest}"


def outcome_record(outcome: OperationOutcome) -> dict[str, Any]:
    """The JSON-able result an entry keeps: the outcome without ``replayed`` and ``directory``."""
    record = dataclasses.asdict(outcome)
    record.pop("replayed")
    record.pop("directory", None)
    if "files" in record:
        record["files"] = [dict(f) for f in record["files"]]
    return record


def outcome_from_record(cls: type[OutcomeT], record: dict[str, Any], **changes: Any) -> OutcomeT:
    """Rebuild an outcome of class ``cls`` from ``outcome_record``'s dict."""
    values = dict(record, **changes)
    if "files" in values:
        values["files"] = tuple(ExportedFile(**f) for f in values["files"])
    if "logprobs" in values:
        values["logprobs"] = tuple(tuple(row) for row in values["logprobs"])
    return cls(**values)


def check_operation_key(key: str) -> None:
    """InvalidArgument unless ``key`` is a non-empty operation key within ``MAX_KEY_CHARS``."""
    if not key:
        raise InvalidArgument("operation_key is required: send a stable key for every operation")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidArgument(
            f"operation_key is {len(key)} characters; the limit is {MAX_KEY_CHARS}"
        )

"""The ledger: the state directory's one durable database, and its one writer.

One SQLite database (``ledger.sqlite3`` at the state directory's root, WAL, ``synchronous=FULL``:
a committed row survives a power cut) holds what every run's keys applied and returned (the
``operations`` table, one row per run and key: ``journal.Journal`` is a run's view of it) and
every request and result the Tinker intake must not lose (the ``records`` table:
``request_store.RequestStore``).

Every durable write of either kind goes through ``write``: one thread takes the writes queued
while the last commit reached the disk and commits them together in one transaction (group
commit: one fsync for many callers, whichever table they write). A write's Future completes once
its transaction is on disk. Each write runs in a savepoint of its own, so a write whose statements
fail (a key already live, a full disk) fails alone; a commit that fails fails every write in it.
Reads go through a second connection, so a lookup never waits for a commit's fsync.

A ledger the state directory created is never opened as a new, empty one (``store_check``):
missing, empty or failing SQLite's quick_check, it stops the server at start, naming the file.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from trainwire.server.service.store_check import check_store, mark_created

logger = logging.getLogger(__name__)

LEDGER_FILE = "ledger.sqlite3"
SCHEMA_VERSION = 1
T = TypeVar("T")
Statements = Callable[[sqlite3.Connection], Any]  # a write's statements, on the writing connection

_SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
    run            TEXT NOT NULL,
    operation_key  TEXT NOT NULL,
    kind           TEXT NOT NULL,
    payload_sha256 TEXT NOT NULL,
    position       INTEGER NOT NULL,
    result         TEXT NOT NULL,
    rolled_back    INTEGER NOT NULL DEFAULT 0,
    recorded_at    REAL NOT NULL,
    PRIMARY KEY (run, operation_key)
);
CREATE INDEX IF NOT EXISTS operations_by_position ON operations (run, position);
CREATE TABLE IF NOT EXISTS records (
    place      INTEGER PRIMARY KEY,
    kind       TEXT NOT NULL,
    owner      TEXT,
    record     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS records_by_owner ON records (owner);
"""


def ledger_path(state_dir: Path) -> Path:
    """Where the ledger of the state directory ``state_dir`` lives."""
    return Path(state_dir) / LEDGER_FILE


def check_ledger(path: Path) -> None:
    """``DamagedStore`` naming the ledger at ``path`` and what to do, when the state directory
    created it and it is now missing, empty or damaged."""
    check_store(
        path,
        what="the ledger",
        table="operations",
        afresh=(
            "start afresh, losing every run's record of the keys it applied (a re-sent key "
            "runs again) and the Tinker requests and results it held"
        ),
    )


@dataclass
class Write:
    """One queued write: its ``statements``, what it writes (for the log) and its commit."""

    statements: Statements
    label: str
    committed: futures.Future[Any] = field(default_factory=futures.Future)


class Ledger:
    """The ledger of the state directory at ``root`` (created on first use). Thread-safe."""

    def __init__(self, root: str | Path) -> None:
        self.path = ledger_path(Path(root))
        check_ledger(self.path)
        # isolation_level=None: no implicit transactions; each batch is one explicit transaction.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        mark_created(self.path)  # from here on, the ledger missing or empty is damage
        self._read_lock = threading.Lock()
        self._reader = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._queue: queue.SimpleQueue[Write | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = threading.Thread(
            target=self._commit_queued, name="trainwire-ledger", daemon=True
        )
        self._writer.start()

    def close(self) -> None:
        """Commit what is queued, then close (a write queued before is durable after)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        self._queue.put(None)
        writer.join()
        with self._read_lock:
            self._reader.close()
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, statements: Statements, label: str = "") -> futures.Future[Any]:
        """Queue ``statements`` (given the writing connection, inside a transaction) for the
        next group commit; the Future gives what they returned once their transaction is on
        disk, or their error (theirs, or the commit's)."""
        queued = Write(statements, label)
        if self._writer is None:
            queued.committed.set_exception(OSError(f"{self.path} is closed"))
            return queued.committed
        self._queue.put(queued)
        return queued.committed

    def write_now(self, statements: Statements, label: str = "") -> Any:
        """``write`` and wait for its commit: what ``statements`` returned."""
        return self.write(statements, label).result()

    def read(self, query: Callable[[sqlite3.Connection], T]) -> T:
        """``query`` on the reading connection: it sees every committed write."""
        with self._read_lock:
            return query(self._reader)

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
            self._settle(batch)
            if stop:
                return

    def _settle(self, batch: list[Write]) -> None:
        """Commit ``batch`` and complete each write's Future with its outcome."""
        try:
            outcomes = self._transact(batch)
        except BaseException as error:
            logger.error("%s: %d writes not committed: %s", self.path, len(batch), error)
            outcomes = [_Undone(error)] * len(batch)
        for write, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, _Undone):
                write.committed.set_exception(outcome.error)
            else:
                write.committed.set_result(outcome)

    def _transact(self, batch: list[Write]) -> list[Any]:
        """One transaction for ``batch``, each write in a savepoint: what each write returned,
        or ``_Undone`` with the error that undid it; raises when the commit itself fails
        (nothing of the batch is stored then)."""
        db = self._db
        outcomes: list[Any] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            for write in batch:
                db.execute("SAVEPOINT write")
                try:
                    outcome = write.statements(db)
                except Exception as error:
                    if not db.in_transaction:
                        # SQLite undid the whole transaction (a full disk can): the writes before
                        # this one are lost with it; the rest go on in a new one.
                        outcomes = [_Undone(error)] * len(outcomes)
                        db.execute("BEGIN IMMEDIATE")
                    else:
                        db.execute("ROLLBACK TO write")
                        db.execute("RELEASE write")
                    outcomes.append(_Undone(error))
                    continue
                db.execute("RELEASE write")
                outcomes.append(outcome)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return outcomes


@dataclass(frozen=True)
class _Undone:
    """A write that is not stored, and why."""

    error: BaseException

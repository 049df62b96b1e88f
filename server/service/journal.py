"""A run's operation journal: which operation keys it has applied, and what they returned.

The journal is a run's view of the ledger's ``operations`` table (``ledger``: one SQLite database
per state directory, group-committed, WAL with ``synchronous=FULL``): a committed entry survives
a power cut. ``commit_async`` queues an entry for the ledger's writer, which commits what is
queued together (of every run, and the intake's records) in one transaction, and its Future
completes once the entry is on disk; ``commit`` waits for that. The active run looks a key up
before running anything (same payload → the journaled result; other payload → ALREADY_EXISTS)
and commits each applied operation with its position. An entry's ``result`` is the operation's
outcome in the JSON form ``outcome_record`` gives it; ``outcome_from_record`` reads it back. An
entry's ``kind`` is its operation's (``operations.OPERATIONS``); the journal stores it and never
interprets it.

A restart rolls the session back to its latest checkpoint; the entries after it are marked
``rolled_back`` rather than deleted, so their keys run again when the controller replays them (the
new run replaces the rolled-back row) while the log of what happened stays readable.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from trainwire.contract.config import canonical_json, sha256_fingerprint
from trainwire.contract.outcomes import ExportedFile, OperationOutcome
from trainwire.server.errors import InvalidArgument
from trainwire.server.service.ledger import Ledger

MAX_KEY_CHARS = 1024
OutcomeT = TypeVar("OutcomeT", bound=OperationOutcome)
_COLUMNS = "operation_key, kind, payload_sha256, position, result, rolled_back, recorded_at"


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
    """The journal of run ``run_id`` in ``ledger``. Thread-safe; the host serializes a run's
    operations anyway, so contention is nil."""

    def __init__(self, ledger: Ledger, run_id: str) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self._state = threading.Lock()  # the pending entries, the failure
        self._pending: dict[str, tuple[JournalEntry, futures.Future[None]]] = {}
        self._failure: BaseException | None = None

    def close(self) -> None:
        """Wait for this run's queued commits (an entry queued before is durable after, or
        failed); the ledger stays open for the others."""
        with self._state:
            pending = [future for _, future in self._pending.values()]
        futures.wait(pending)

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
        row = self.ledger.read(
            lambda db: db.execute(
                f"SELECT {_COLUMNS} FROM operations "
                "WHERE run = ? AND operation_key = ? AND rolled_back = 0",
                (self.run_id, operation_key),
            ).fetchone()
        )
        return None if row is None else _entry(row)

    def returned_name(self, kind: str, name: str) -> bool:
        """Whether a live entry of ``kind``, queued or committed, returned ``name`` (its
        result's ``name``): an export this run's timeline wrote, say, as against one a crash
        left behind before its entry committed (its key runs again, and writes it again)."""
        with self._state:
            pending = [entry for entry, _ in self._pending.values()]
        if any(e.kind == kind and e.result.get("name") == name for e in pending):
            return True
        row = self.ledger.read(
            lambda db: db.execute(
                "SELECT 1 FROM operations WHERE run = ? AND kind = ? AND rolled_back = 0 "
                "AND json_extract(result, '$.name') = ? LIMIT 1",
                (self.run_id, kind, name),
            ).fetchone()
        )
        return row is not None

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
        written = self.ledger.write(partial(_insert, self.run_id, entry), entry.operation_key)
        written.add_done_callback(partial(self._settle, entry.operation_key, future))
        return future

    def _settle(
        self, operation_key: str, future: futures.Future[None], written: futures.Future[Any]
    ) -> None:
        """Once the ledger committed (or failed) an entry: it is no longer pending, and its
        caller hears how it went."""
        error = written.exception()
        with self._state:
            if self._pending.get(operation_key, (None, None))[1] is future:
                del self._pending[operation_key]
            if error is not None:
                self._failure = error
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def roll_back_after(self, position: int) -> int:
        """Mark every live entry past ``position`` rolled back; returns how many."""
        return self._update(
            "UPDATE operations SET rolled_back = 1 "
            "WHERE run = ? AND position > ? AND rolled_back = 0",
            position,
        )

    def roll_back_others_at(self, position: int, operation_key: str) -> int:
        """Mark live entries at ``position`` under another key rolled back; returns how many.
        One position holds one operation: the checkpoint recovery restores says which."""
        return self._update(
            "UPDATE operations SET rolled_back = 1 "
            "WHERE run = ? AND position = ? AND operation_key != ? AND rolled_back = 0",
            position,
            operation_key,
        )

    def _update(self, statement: str, *parameters: Any) -> int:
        """``statement`` on this run's rows, durably; how many rows it changed."""
        values = (self.run_id, *parameters)
        return self.ledger.write_now(lambda db: db.execute(statement, values).rowcount)

    def entries(self, *, include_rolled_back: bool = False) -> list[JournalEntry]:
        """Entries in position order (rolled-back ones after live ones at the same position)."""
        live = "" if include_rolled_back else "AND rolled_back = 0"
        rows = self.ledger.read(
            lambda db: db.execute(
                f"SELECT {_COLUMNS} FROM operations WHERE run = ? {live} "
                "ORDER BY position, rolled_back, recorded_at",
                (self.run_id,),
            ).fetchall()
        )
        return [_entry(row) for row in rows]

    def last(self) -> JournalEntry | None:
        """The live entry with the highest position, or None."""
        row = self.ledger.read(
            lambda db: db.execute(
                f"SELECT {_COLUMNS} FROM operations WHERE run = ? AND rolled_back = 0 "
                "ORDER BY position DESC LIMIT 1",
                (self.run_id,),
            ).fetchone()
        )
        return None if row is None else _entry(row)


def forget_run(ledger: Ledger, run_id: str) -> None:
    """Delete every entry of run ``run_id``, durably (its files are being removed: a run of
    that id opened later starts with no keys)."""
    ledger.write_now(lambda db: db.execute("DELETE FROM operations WHERE run = ?", (run_id,)))


def _insert(run_id: str, entry: JournalEntry, db: sqlite3.Connection) -> None:
    """``entry``'s row, in place of a rolled-back one of its key; ``sqlite3.IntegrityError`` if
    a live entry holds the key (the host never asks)."""
    db.execute(
        "DELETE FROM operations WHERE run = ? AND operation_key = ? AND rolled_back = 1",
        (run_id, entry.operation_key),
    )
    db.execute(
        "INSERT INTO operations VALUES (?, ?, ?, ?, ?, ?, 0, ?)",
        (
            run_id,
            entry.operation_key,
            entry.kind,
            entry.payload_sha256,
            entry.position,
            json.dumps(entry.result, sort_keys=True),
            entry.recorded_at or time.time(),
        ),
    )


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
    """What an operation key is bound to in the journal: ``value``, one digest per request.

    A request the intake accepted is bound to the digest of its body as it was received (the
    intake hashes every request it takes, so a request is hashed once: ``request:<hex>``); a
    gRPC request to its operation's payload (``payload_digest``).
    """

    value: str

    def matches(self, recorded: str) -> bool:
        return recorded == self.value


def request_digest(body_digest: str) -> str:
    """The journal's form of the digest the intake took of a request's body."""
    return f"request:{body_digest}"


def outcome_record(outcome: OperationOutcome) -> dict[str, Any]:
    """The JSON-able result an entry keeps: the outcome without ``replayed`` and ``directory``.

    Field by field, not ``dataclasses.asdict``: that deep-copies every value on the engine
    thread, and a forward_backward's logprobs are one float per target token (128 x 512 of them
    took 123 ms there, against microseconds here). The values are immutable (numbers, strings,
    tuples of floats) but for the metrics dict, copied, and the exported files, as dicts."""
    record = {
        field.name: getattr(outcome, field.name)
        for field in dataclasses.fields(outcome)
        if field.name not in ("replayed", "directory")
    }
    if "metrics" in record:
        record["metrics"] = dict(record["metrics"])
    if "files" in record:
        record["files"] = [dataclasses.asdict(f) for f in record["files"]]
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

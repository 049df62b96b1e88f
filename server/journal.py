"""The durable operation journal: which operation keys a run has applied, and what they returned.

One SQLite database per run, in WAL mode with ``synchronous=FULL``: a committed entry survives a
power cut, and ``commit`` returns only after the commit. The active run looks a key up before
running anything (same payload → the journaled result; other payload → ALREADY_EXISTS) and commits
each applied operation with its position. An entry's ``result`` is the operation's outcome in the
JSON form ``outcome_record`` gives it; ``outcome_from_record`` reads it back.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from trainwire.client import outcomes
from trainwire.client.config import canonical_json, sha256_fingerprint
from trainwire.client.outcomes import ExportedFile, OperationOutcome
from trainwire.server.errors import InvalidArgument

JOURNAL_FILE = "journal.sqlite3"
MAX_KEY_CHARS = 1024
SCHEMA_VERSION = 1
OutcomeT = TypeVar("OutcomeT", bound=OperationOutcome)

# The state-changing operation kinds, spelled as their RPCs: an entry's ``kind``.
FORWARD_BACKWARD = "ForwardBackward"
OPTIM_STEP = "OptimStep"
SAVE_STATE = "SaveState"
LOAD_STATE = "LoadState"
LOAD_WEIGHTS = "LoadWeights"
EXPORT_WEIGHTS = "ExportWeights"
# What each kind's journaled result is read back as.
OUTCOME_TYPES: dict[str, type[OperationOutcome]] = {
    FORWARD_BACKWARD: outcomes.ForwardBackwardOutcome,
    OPTIM_STEP: outcomes.OptimStepOutcome,
    SAVE_STATE: outcomes.CheckpointOutcome,
    LOAD_STATE: outcomes.CheckpointOutcome,
    LOAD_WEIGHTS: OperationOutcome,
    EXPORT_WEIGHTS: outcomes.ExportOutcome,
}

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
        self._lock = threading.Lock()
        # isolation_level=None: no implicit transactions; each write is one explicit transaction.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lookup(self, operation_key: str) -> JournalEntry | None:
        """The live (not rolled back) entry for ``operation_key``, or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM operations WHERE operation_key = ? AND rolled_back = 0",
                (operation_key,),
            ).fetchone()
        return None if row is None else _entry(row)

    def commit(self, entry: JournalEntry) -> None:
        """Commit ``entry`` durably; it replaces a rolled-back entry of the same key.

        Raises ``sqlite3.IntegrityError`` if a live entry holds the key (the host never asks).
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
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

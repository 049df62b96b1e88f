"""A SQLite store the state directory remembers: one that is gone, empty or damaged stops its
opener instead of opening as a new, empty database.

SQLite takes a missing or zero-byte file for a new database, so a store cut to nothing (its
``-wal`` gone too) would open empty: a server would start healthy and forget every request id
it handed out. A page overwritten with garbage opens too, and fails later, on every write.
So the state directory remembers each store it created: a marker file beside it
(``<store>.created``), written once the store's schema is committed. At open, a store whose
marker is there must exist, hold its schema and pass ``PRAGMA quick_check``; otherwise
``DamagedStore`` names the file and what to do. A store without a marker was never handed a
record (the marker is written before its first one), so it is checked as found and marked.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from trainwire.contract.files import write_text_atomic

MARKER_SUFFIX = ".created"
MARKER_TEXT = "this SQLite store was created here; a server refuses to start without it\n"


class DamagedStore(OSError):
    """A store the state directory created is missing, empty or fails SQLite's quick_check:
    nothing is served from it (``trainwire serve`` stops at start with this one line)."""


def marker_of(path: Path) -> Path:
    """The file whose presence says the store at ``path`` was created."""
    return path.with_name(path.name + MARKER_SUFFIX)


def check_store(path: Path, *, what: str, table: str, afresh: str) -> None:
    """Refuse the store at ``path`` (``what`` it is, in words) when its marker is there and it is
    missing, lacks its ``table``, or fails ``PRAGMA quick_check``; a file that is no SQLite
    database is refused with or without a marker. ``afresh`` says what moving it aside starts
    (and loses). It only reads the store (though closing its connection checkpoints a -wal, as
    any last connection does); the caller opens it afterwards."""
    created = marker_of(path).is_file()
    if not path.exists():
        if created:
            raise _damaged(path, what, "is missing", afresh)
        return
    problem = _problem(path, table, created)
    if problem is not None:
        raise _damaged(path, what, problem, afresh)


def mark_created(path: Path) -> None:
    """Remember that the store at ``path`` exists (durably), once its schema is committed."""
    marker = marker_of(path)
    if not marker.is_file():
        write_text_atomic(marker, MARKER_TEXT)


def _problem(path: Path, table: str, created: bool) -> str | None:
    """What is wrong with the store at ``path`` in a few words, or None."""
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True)
    except sqlite3.Error as error:
        return f"cannot be opened ({error})"
    try:
        found = [str(row[0]) for row in db.execute("PRAGMA quick_check")]
        if found != ["ok"]:
            return f"fails SQLite's quick_check ({_first_finding(found)})"
        has_table = db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).fetchone()
    except sqlite3.DatabaseError as error:
        return f"cannot be read as a SQLite database ({error})"
    finally:
        db.close()
    if has_table is None and created:
        return f"is empty (no {table} table: cut to zero bytes, its -wal gone?)"
    return None


def _first_finding(found: list[str]) -> str:
    """quick_check's first finding, on one line (it heads its report with the schema's name)."""
    lines = [line for text in found for line in text.splitlines() if not line.startswith("***")]
    return lines[0] if lines else "no detail"


def _damaged(path: Path, what: str, problem: str, afresh: str) -> DamagedStore:
    return DamagedStore(
        f"{what} {path} {problem}: restore it (and its -wal) from a backup, or move "
        f"{path.name}* aside (the store, its -wal, -shm and {marker_of(path).name}) to {afresh}"
    )

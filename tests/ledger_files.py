"""A state directory's ledger from a test: a run's journal lineage and position read while a
server runs, and a run's journal or the Tinker intake's request store opened with none running."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainwire.server.service.journal import Journal
from trainwire.server.service.ledger import Ledger, ledger_path
from trainwire.server.service.request_records import CallRecord, payload
from trainwire.server.service.request_store import RequestStore
from trainwire.server.tinker.sdk_sessions import session_of


def journal_lineage(state_dir: Path, run_id: str) -> list[tuple[int, str]]:
    """Run ``run_id``'s live entries, (position, key), in position order; read only
    (``sqlite3.Error`` while the ledger is not created yet, or a restart holds it)."""
    uri = f"{ledger_path(state_dir).resolve().as_uri()}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
        return db.execute(
            "SELECT position, operation_key FROM operations WHERE run = ? AND rolled_back = 0 "
            "ORDER BY position",
            (run_id,),
        ).fetchall()


def journal_position(state_dir: Path, run_id: str) -> int:
    """Run ``run_id``'s position as its journal stands (0 before any entry, or no ledger)."""
    if not ledger_path(state_dir).exists():
        return 0
    try:
        lineage = journal_lineage(state_dir, run_id)
    except sqlite3.Error:
        return 0
    return lineage[-1][0] if lineage else 0


@contextlib.contextmanager
def opened_store(state_dir: Path) -> Iterator[RequestStore]:
    """The Tinker intake's request store in ``state_dir``'s ledger, as a (restarted) server
    opens it: to read it, or write records as a server would have, with no server running
    (closed, every write durable, on leaving)."""
    with Ledger(state_dir) as ledger:
        store = RequestStore(ledger, session_of)
        yield store
        store.close()


@contextlib.contextmanager
def opened_journal(state_dir: Path, run_id: str) -> Iterator[Journal]:
    """Run ``run_id``'s journal in ``state_dir``'s ledger, with no server running (closed on
    leaving)."""
    with Ledger(state_dir) as ledger, Journal(ledger, run_id) as journal:
        yield journal


def stored_call(
    request_id: str,
    operation: str,
    body: Any,
    answer: str,
    note: dict[str, Any] | None = None,
) -> CallRecord:
    """An accepted call of the server's only run as the intake stores it: ``operation`` (a kind
    of the host's table) on ``body`` (its typed request), answered by the encoder ``answer``."""
    digest, size = payload(body)
    seq = int(request_id.rpartition("/")[2])
    return CallRecord(request_id, seq, operation, body, digest, size, "", answer, note)


def stored_save(model_id: str, seq: int, name: str) -> CallRecord:
    """A stored ``save_weights`` of ``model_id``'s checkpoint ``name`` (its catalog note too)."""
    path = f"tinker://{model_id}/weights/{name}"
    note = {"note": "saved_weights", "path": path, "name": name, "ttl_seconds": None, "seq_id": seq}
    body = {"name": name, "run_id": ""}
    return stored_call(f"{model_id}/{seq}", "SaveState", body, "save_weights", note)


def stored_refusal(request_id: str, why: str) -> CallRecord:
    """A call refused when it was accepted, as the intake stores it: it holds its number."""
    return replace(stored_call(request_id, "", {}, ""), refused=why)

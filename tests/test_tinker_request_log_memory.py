"""The request store keeps heavy bodies in its rows, not in memory: a run that sends many large
forward_backward calls between two checkpoints holds their ids, not their bodies. Compaction copies
a heavy record's row as written, and a restart reads the bodies back whole."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ledger_files import opened_store, stored_call

from trainwire.server.service.ledger import ledger_path
from trainwire.server.service.request_records import CallRecord, ResultRecord, SessionRecord
from trainwire.server.service.request_store import HEAVY_RECORD_BYTES, Stored
from trainwire.server.service.results import Done

BODY = bytes(range(256)) * (HEAVY_RECORD_BYTES // 64)  # a body past the bound


def heavy_call(seq: int) -> CallRecord:
    return stored_call(f"m/{seq}", "forward_backward", BODY + bytes([seq]), "forward_backward")


def stored_rows(directory: Path) -> list[str]:
    return [text for _, text in placed_rows(directory)]


def placed_rows(directory: Path) -> list[tuple[int, str]]:
    db = sqlite3.connect(ledger_path(directory))
    try:
        return db.execute("SELECT place, record FROM records ORDER BY place").fetchall()
    finally:
        db.close()


def test_heavy_bodies_stay_in_their_rows_and_compaction_copies_them_whole(tmp_path: Path) -> None:
    small = stored_call("m/3", "optim_step", {"seq_id": 3}, "optim_step")
    with opened_store(tmp_path) as store:
        for record in (SessionRecord("s"), heavy_call(1), heavy_call(2), small):
            store.write(record)
        store.write(ResultRecord("m/2", Done(BODY)))
        calls = {r.request_id: r for r in store.records if isinstance(r, CallRecord)}
        assert isinstance(calls["m/1"].body, Stored) and isinstance(calls["m/2"].body, Stored)
        assert calls["m/3"].body == {"seq_id": 3}
        result = next(r for r in store.records if isinstance(r, ResultRecord))
        assert isinstance(result.outcome, Done) and isinstance(result.outcome.body, Stored)
        listed, answered = store.calls(("forward_backward",))  # ids and notes, bodies left
        assert [call.request_id for call in listed] == ["m/1", "m/2"]
        assert answered == {"m/2"}

        before = placed_rows(tmp_path)
        assert store.compact(
            lambda records: [r for r in records if getattr(r, "request_id", "") != "m/1"]
        )
        after = placed_rows(tmp_path)
        # m/1's row deleted; the others kept where they were, as written (never rewritten)
        assert after == [(place, row) for place, row in before if '"m/1"' not in row]
        assert all(not isinstance(getattr(r, "body", None), bytes) for r in store.records)

    with opened_store(tmp_path) as reopened:  # a restart reads every body back whole
        calls_back = [r for r in reopened.records if isinstance(r, CallRecord)]
        assert [(c.request_id, c.body) for c in calls_back] == [
            ("m/2", BODY + b"\x02"),
            ("m/3", small.body),
        ]
        assert calls_back[0].answer == "forward_backward"
        reopened.leave_bodies_on_disk()  # taken back: left in the row again
        first = next(r for r in reopened.records if isinstance(r, CallRecord))
        assert isinstance(first.body, Stored)
        assert reopened.compact(list)  # and compacts from there, still whole
        requests = placed_rows(tmp_path)[1:]
        head = [SessionRecord("t"), *reopened.records[1:]]  # a new head, the requests kept
        assert reopened.compact(lambda records: head)
        (first_place, first_row), *rest = placed_rows(tmp_path)
        assert rest == requests  # in place, untouched; the new head written below them
        assert first_place < requests[0][0] and '"session_id":"t"' in first_row
        assert reopened.records[0] == SessionRecord("t")
    with opened_store(tmp_path) as again:
        assert next(r.body for r in again.records if isinstance(r, CallRecord)) == BODY + b"\x02"

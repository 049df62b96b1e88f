"""The operation journal: durable, keyed, and rolled back (not forgotten) on a restart."""

from __future__ import annotations

import sqlite3

import pytest

from trainwire.server.service.journal import Journal, JournalEntry


def entry(key: str, position: int, **result) -> JournalEntry:
    return JournalEntry(key, "ForwardBackward", f"sha256:{key}", position, result)


@pytest.fixture
def journal(tmp_path):
    with Journal(tmp_path / "journal.sqlite3") as j:
        yield j


def test_a_recorded_entry_is_found_by_its_key_with_its_exact_result(journal):
    journal.commit(entry("a", 1, loss=0.1 + 0.2, nested={"x": [1, 2]}))

    found = journal.lookup("a")

    assert found.position == 1 and found.payload_sha256 == "sha256:a"
    assert found.result == {"loss": 0.1 + 0.2, "nested": {"x": [1, 2]}}  # floats round-trip
    assert journal.lookup("b") is None


def test_the_journal_runs_in_wal_mode_with_full_sync(journal):
    db = sqlite3.connect(journal.path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()
    # synchronous is per connection: the journal's own must be FULL (2).
    assert journal._db.execute("PRAGMA synchronous").fetchone()[0] == 2


def test_committed_entries_survive_reopening(tmp_path):
    path = tmp_path / "journal.sqlite3"
    with Journal(path) as first:
        first.commit(entry("a", 1))
        first.commit(entry("b", 2))

    with Journal(path) as again:
        assert [e.operation_key for e in again.entries()] == ["a", "b"]
        assert again.last().operation_key == "b"


def test_a_live_key_cannot_be_recorded_twice(journal):
    journal.commit(entry("a", 1, loss=1.0))

    with pytest.raises(sqlite3.IntegrityError):
        journal.commit(entry("a", 2, loss=2.0))

    assert journal.lookup("a").result == {"loss": 1.0}
    assert len(journal.entries(include_rolled_back=True)) == 1


def test_rolling_back_hides_later_entries_and_lets_their_keys_run_again(journal):
    for position, key in enumerate("abcd", start=1):
        journal.commit(entry(key, position, loss=float(position)))

    assert journal.roll_back_after(2) == 2

    assert [e.operation_key for e in journal.entries()] == ["a", "b"]
    assert journal.lookup("c") is None
    assert journal.last().operation_key == "b"
    rolled = [e for e in journal.entries(include_rolled_back=True) if e.rolled_back]
    assert [e.operation_key for e in rolled] == ["c", "d"]

    journal.commit(entry("c", 3, loss=30.0))  # replayed after the restart: replaces the old row

    assert journal.lookup("c").result == {"loss": 30.0}
    assert [
        (e.operation_key, e.rolled_back) for e in journal.entries(include_rolled_back=True)
    ] == [
        ("a", False),
        ("b", False),
        ("c", False),
        ("d", True),
    ]

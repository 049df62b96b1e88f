"""The operation journal: durable, keyed, and rolled back (not forgotten) on a restart; each
run's journal is its rows of the state directory's one ledger."""

from __future__ import annotations

import sqlite3

import pytest

from trainwire.server.service.journal import Journal, JournalEntry, forget_run
from trainwire.server.service.ledger import LEDGER_FILE, Ledger, Write


def entry(key: str, position: int, **result) -> JournalEntry:
    return JournalEntry(key, "ForwardBackward", f"sha256:{key}", position, result)


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path) as opened:
        yield opened


@pytest.fixture
def journal(ledger):
    with Journal(ledger, "run") as j:
        yield j


def test_a_recorded_entry_is_found_by_its_key_with_its_exact_result(journal):
    journal.commit(entry("a", 1, loss=0.1 + 0.2, nested={"x": [1, 2]}))

    found = journal.lookup("a")

    assert found.position == 1 and found.payload_sha256 == "sha256:a"
    assert found.result == {"loss": 0.1 + 0.2, "nested": {"x": [1, 2]}}  # floats round-trip
    assert journal.lookup("b") is None


def test_the_ledger_runs_in_wal_mode_with_full_sync(ledger, tmp_path):
    assert ledger.path == tmp_path / LEDGER_FILE
    db = sqlite3.connect(ledger.path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()
    # synchronous is per connection: the writer's own must be FULL (2).
    assert ledger.write_now(lambda db: db.execute("PRAGMA synchronous").fetchone()[0]) == 2


def test_committed_entries_survive_reopening(tmp_path):
    with Ledger(tmp_path) as ledger:
        first = Journal(ledger, "run")
        first.commit(entry("a", 1))
        first.commit(entry("b", 2))

    with Ledger(tmp_path) as ledger:
        again = Journal(ledger, "run")
        assert [e.operation_key for e in again.entries()] == ["a", "b"]
        assert again.last().operation_key == "b"


def test_runs_keep_their_keys_and_positions_apart_in_one_ledger(ledger):
    one, two = Journal(ledger, "one"), Journal(ledger, "two")
    one.commit(entry("a", 1, loss=1.0))
    two.commit(entry("a", 1, loss=2.0))  # the same key in another run: its own entry
    two.commit(entry("b", 2))

    assert one.lookup("a").result == {"loss": 1.0} and two.lookup("a").result == {"loss": 2.0}
    assert one.lookup("b") is None and one.last().operation_key == "a"
    assert two.roll_back_after(0) == 2
    assert one.lookup("a") is not None and two.entries() == []

    forget_run(ledger, "two")  # its files removed: a run of that id starts with no keys

    assert Journal(ledger, "two").entries(include_rolled_back=True) == []
    assert [e.operation_key for e in one.entries()] == ["a"]


def test_writes_committed_together_fail_alone(ledger):
    """Writes gathered into one transaction: one whose statements fail is undone alone (its
    savepoint), and the others commit."""

    def record(place):
        return lambda db: (
            db.execute("INSERT INTO records VALUES (?, 'session', NULL, '{}')", (place,)).rowcount
        )

    batch = [Write(record(1), "first"), Write(record(1), "again"), Write(record(2), "after")]
    ledger._settle(batch)  # as the writer does with what it gathered

    assert batch[0].committed.result() == 1 and batch[2].committed.result() == 1
    with pytest.raises(sqlite3.IntegrityError):
        batch[1].committed.result()
    places = ledger.read(lambda db: db.execute("SELECT place FROM records").fetchall())
    assert places == [(1,), (2,)]


def test_after_a_failed_commit_a_runs_journal_takes_no_more_entries(ledger):
    journal = Journal(ledger, "run")
    journal.commit(entry("a", 1))
    with pytest.raises(sqlite3.IntegrityError):  # a live key again (the host never asks)
        journal.commit(entry("a", 2))
    Journal(ledger, "x").commit(entry("b", 1))  # another run's journal goes on

    with pytest.raises(RuntimeError, match="an earlier commit failed"):
        journal.commit(entry("c", 2))
    assert Journal(ledger, "x").lookup("b").position == 1


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

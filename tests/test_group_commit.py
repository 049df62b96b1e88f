"""Group commit: the next operation runs while the last one's commit reaches the disk, and no
caller hears of an operation before its entry is durable."""

from __future__ import annotations

import threading
import time

import pytest
from host_operations import BATCHES, op

from trainwire.server.errors import FailedPrecondition, Unavailable
from trainwire.server.service import operations as ops
from trainwire.server.service.journal import Journal, JournalEntry
from trainwire.server.service.ledger import Ledger
from trainwire.server.service.requests import CheckpointRequest, ForwardBackwardRequest


def entry(key: str, position: int) -> JournalEntry:
    return JournalEntry(key, "OptimStep", "sha256:x", position, {"step": position})


def held_writes(
    ledger: Ledger, monkeypatch, events: list[str] | None = None
) -> tuple[threading.Event, list[list[str]]]:
    """Make ``ledger``'s transactions wait for the returned event; record each batch's keys
    (and, in ``events``, ``writing <keys>`` when a transaction starts and ``durable <key>`` once
    each entry is on disk)."""
    release, batches = threading.Event(), []
    events = [] if events is None else events
    real_transact = ledger._transact

    def transact(writes):
        keys = [write.label for write in writes]
        events.append(f"writing {' '.join(keys)}")
        release.wait(30)
        batches.append(keys)
        outcomes = real_transact(writes)
        events.extend(f"durable {key}" for key in keys)
        return outcomes

    monkeypatch.setattr(ledger, "_transact", transact)
    return release, batches


def entered(journal: Journal, monkeypatch) -> threading.Event:
    """Set once an operation starts waiting for every earlier commit (a SaveState does)."""
    waiting, real_wait = threading.Event(), journal.wait_all_durable

    def wait_all_durable() -> None:
        waiting.set()
        real_wait()

    monkeypatch.setattr(journal, "wait_all_durable", wait_all_durable)
    return waiting


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still false after {timeout_s} s"
        time.sleep(0.01)


def test_entries_queued_together_commit_in_one_transaction_in_order(tmp_path, monkeypatch):
    with Ledger(tmp_path) as ledger:
        journal = Journal(ledger, "run")
        events: list[str] = []
        release, batches = held_writes(ledger, monkeypatch, events)
        first = journal.commit_async(entry("a", 1))
        wait_until(lambda: "writing a" in events)  # the committer holds "a" on the disk
        rest = [journal.commit_async(entry(key, i)) for i, key in enumerate("bcd", start=2)]
        assert journal.lookup("c").position == 3  # seen at once, before it is durable
        assert not any(f.done() for f in (first, *rest))
        release.set()
        for future in (first, *rest):
            future.result(timeout=30)
        assert batches == [["a"], ["b", "c", "d"]]
        assert journal.durable("c") is None
        assert [e.operation_key for e in journal.entries()] == ["a", "b", "c", "d"]


def test_the_next_operation_runs_while_the_last_ones_commit_waits_and_neither_returns_early(
    host, monkeypatch
):
    events: list[str] = []  # appended to by the writer and the callers, in the order it happened
    release, _ = held_writes(host.ledger, monkeypatch, events)
    results: dict[str, object] = {}

    def call(key: str, position: int) -> None:
        request = ForwardBackwardRequest(BATCHES[position])
        results[key] = host.apply(ops.FORWARD_BACKWARD, request, op(key, position))
        events.append(f"answered {key}")

    first = threading.Thread(target=call, args=("a", 0))
    second = threading.Thread(target=call, args=("b", 1))
    first.start()
    wait_until(lambda: host.session.accumulated >= 1)
    second.start()
    wait_until(lambda: host.session.accumulated >= 2)  # applied while "a" is not on disk
    assert results == {} and "durable a" not in events
    release.set()
    first.join(30)
    second.join(30)
    assert (results["a"].position, results["b"].position) == (1, 2)
    assert [e.operation_key for e in host.journal.entries()] == ["a", "b"]
    # Neither caller heard of its operation before its entry was on disk, whatever the timing.
    for key in ("a", "b"):
        assert events.index(f"durable {key}") < events.index(f"answered {key}"), events


def test_a_commit_that_fails_fails_the_server_and_nothing_after_it_is_heard_of(host, monkeypatch):
    def broken(writes):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(host.ledger, "_transact", broken)
    with pytest.raises(FailedPrecondition, match=r"could not record 'a'.*restart the server"):
        host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("a", 0))
    with pytest.raises(Unavailable, match="cannot serve its session"):
        host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("b", 1))


def test_a_save_writes_its_checkpoint_only_once_every_earlier_commit_is_durable(host, monkeypatch):
    """Issue 21.1: a checkpoint holding an operation whose commit a crash could still lose would
    be restored with it applied and unjournaled, and its re-sent call would apply it twice."""
    release, batches = held_writes(host.ledger, monkeypatch)
    save_waits = entered(host.journal, monkeypatch)
    checkpoint = host.state_dir.run("run").checkpoint("c")
    results: dict[str, object] = {}
    fb = ForwardBackwardRequest(BATCHES[0])
    threads = [
        threading.Thread(
            target=lambda: results.update(a=host.apply(ops.FORWARD_BACKWARD, fb, op("a", 0)))
        ),
        threading.Thread(
            target=lambda: results.update(
                c=host.apply(ops.SAVE_STATE, CheckpointRequest("c"), op("c", 1))
            )
        ),
    ]
    threads[0].start()
    wait_until(lambda: host.session.accumulated >= 1)  # "a" applied, its commit held
    threads[1].start()
    assert save_waits.wait(30), "the save did not wait for the earlier commit"
    assert not checkpoint.exists() and results == {}
    release.set()
    for thread in threads:
        thread.join(30)
    assert checkpoint.is_dir() and (results["a"].position, results["c"].position) == (1, 2)
    assert batches == [["a"], ["c"]]


def test_a_save_behind_a_commit_that_fails_writes_no_checkpoint(host, monkeypatch):
    release, _ = held_writes(host.ledger, monkeypatch)
    real_transact = host.ledger._transact

    def held_then_full(writes):
        real_transact([])  # waits for the release, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(host.ledger, "_transact", held_then_full)
    save_waits = entered(host.journal, monkeypatch)
    checkpoint = host.state_dir.run("run").checkpoint("c")
    errors: dict[str, BaseException] = {}

    def call(name: str, operation, request, spec) -> None:
        try:
            host.apply(operation, request, spec)
        except Exception as error:
            errors[name] = error

    fb = threading.Thread(
        target=call,
        args=("a", ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("a", 0)),
    )
    fb.start()
    wait_until(lambda: host.session.accumulated >= 1)
    save = threading.Thread(
        target=call, args=("c", ops.SAVE_STATE, CheckpointRequest("c"), op("c", 1))
    )
    save.start()
    assert save_waits.wait(30), "the save did not wait for the earlier commit"
    release.set()
    fb.join(30)
    save.join(30)
    assert not checkpoint.exists()
    assert isinstance(errors["c"], FailedPrecondition | Unavailable)
    assert host.phase == "failed"

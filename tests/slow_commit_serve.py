"""``trainwire serve`` on a slow disk for journal entries: each takes ``DELAY_S`` longer to reach
the ledger's commit, while request records commit as they always do.

Run as ``python tests/slow_commit_serve.py DELAY_S serve ...``. A crash test needs a window it can
aim a SIGKILL into: here, between an operation applied by the engine and its journal entry on
disk, while a later SaveState waits (and, on the Tinker transport, after the save's own request
record is durable: records and entries share the ledger's one writer, so the delay is put in
front of the journal's writes, never inside a transaction a record shares). The delay is injected
from the outside, around the ledger's real writer, so the server under test is the real one.

So that a test aims by state, never by the clock, the server writes what happens in that window
to ``<state dir>.events`` (beside the state directory, one line each): ``commit <key>`` when a
journal write starts on the slow disk (a rollback's key is empty), ``committed <key>`` once it is
on disk, and ``durable-wait`` when an operation (a SaveState) starts waiting for every earlier
commit. ``events`` reads them.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from trainwire.cli import main
from trainwire.server.service.journal import Journal
from trainwire.server.service.ledger import Ledger, Statements
from trainwire.server.service.request_store import RECORD_LABEL

EVENTS_SUFFIX = ".events"
Delayed = tuple[Ledger, Statements, str, futures.Future[Any]]


def events(state_dir: Path) -> list[str]:
    """What the slow server under ``state_dir`` recorded so far."""
    path = state_dir.with_name(state_dir.name + EVENTS_SUFFIX)
    return path.read_text().splitlines() if path.is_file() else []


def slow_disk(delay_s: float, events_file: Path) -> None:
    real_write, real_wait = Ledger.write, Journal.wait_all_durable
    slow: queue.SimpleQueue[Delayed] = queue.SimpleQueue()

    def record(lines: list[str]) -> None:
        with events_file.open("a") as file:
            file.writelines(line + "\n" for line in lines)

    def land() -> None:
        """The slow disk: what waits goes on together, in order, ``delay_s`` later."""
        while True:
            batch = [slow.get()]
            while not slow.empty():
                batch.append(slow.get())
            time.sleep(delay_s)
            for ledger, statements, label, done in batch:
                real_write(ledger, statements, label).add_done_callback(
                    lambda written, done=done: _pass_on(written, done)
                )

    def write(self: Ledger, statements: Statements, label: str = "") -> futures.Future[Any]:
        if label.startswith(f"{RECORD_LABEL} "):
            return real_write(self, statements, label)
        record([f"commit {label}"])
        done: futures.Future[Any] = futures.Future()
        done.add_done_callback(lambda _: record([f"committed {label}"]))  # before its caller
        slow.put((self, statements, label, done))
        return done

    def wait_all_durable(self: Journal) -> None:
        record(["durable-wait"])
        real_wait(self)

    threading.Thread(target=land, name="slow-disk", daemon=True).start()
    Ledger.write = write  # type: ignore[method-assign]
    Journal.wait_all_durable = wait_all_durable  # type: ignore[method-assign]


def _pass_on(written: futures.Future[Any], done: futures.Future[Any]) -> None:
    error = written.exception()
    if error is None:
        done.set_result(written.result())
    else:
        done.set_exception(error)


def state_dir_of(argv: Sequence[str]) -> Path:
    for index, item in enumerate(argv):
        if item == "--state-dir":
            return Path(argv[index + 1])
        if item.startswith("--state-dir="):
            return Path(item.split("=", 1)[1])
    raise SystemExit("slow_commit_serve: give serve a --state-dir")


if __name__ == "__main__":
    state_dir = state_dir_of(sys.argv[2:])
    slow_disk(float(sys.argv[1]), state_dir.with_name(state_dir.name + EVENTS_SUFFIX))
    sys.exit(main(sys.argv[2:]))

"""``trainwire serve`` on a slow disk: every journal commit takes ``DELAY_S`` longer.

Run as ``python tests/slow_commit_serve.py DELAY_S serve ...``. A crash test needs a window it can
aim a SIGKILL into: here, between an operation applied by the engine and its journal entry on
disk, while a later SaveState waits. The delay is injected from the outside, around the journal's
real write, so the server under test is the real one.

So that a test aims by state, never by the clock, the server writes what happens in that window
to ``<state dir>.events`` (beside the state directory, one line each): ``commit <keys>`` when a
commit starts on the slow disk, ``committed <keys>`` once it is on disk, and ``durable-wait``
when an operation (a SaveState) starts waiting for every earlier commit. ``events`` reads them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trainwire.cli import main
from trainwire.server.service.journal import Journal

EVENTS_SUFFIX = ".events"


def events(state_dir: Path) -> list[str]:
    """What the slow server under ``state_dir`` recorded so far."""
    path = state_dir.with_name(state_dir.name + EVENTS_SUFFIX)
    return path.read_text().splitlines() if path.is_file() else []


def slow_disk(delay_s: float, events_file: Path) -> None:
    real_write, real_wait = Journal._write, Journal.wait_all_durable

    def record(line: str) -> None:
        with events_file.open("a") as file:
            file.write(line + "\n")

    def write(self: Journal, entries: list) -> None:
        keys = " ".join(entry.operation_key for entry in entries)
        record(f"commit {keys}")
        time.sleep(delay_s)
        real_write(self, entries)
        record(f"committed {keys}")

    def wait_all_durable(self: Journal) -> None:
        record("durable-wait")
        real_wait(self)

    Journal._write = write  # type: ignore[method-assign]
    Journal.wait_all_durable = wait_all_durable  # type: ignore[method-assign]


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

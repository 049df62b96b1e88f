"""``trainwire serve`` on a slow disk: every journal commit takes ``DELAY_S`` longer.

Run as ``python tests/slow_commit_serve.py DELAY_S serve ...``. A crash test needs a window it can
aim a SIGKILL into: here, between an operation applied by the engine and its journal entry on
disk, while a later SaveState waits. The delay is injected from the outside, around the journal's
real write, so the server under test is the real one.
"""

from __future__ import annotations

import sys
import time

from trainwire.cli import main
from trainwire.server.service.journal import Journal


def slow_disk(delay_s: float) -> None:
    real_write = Journal._write

    def write(self: Journal, entries: list) -> None:
        time.sleep(delay_s)
        real_write(self, entries)

    Journal._write = write  # type: ignore[method-assign]


if __name__ == "__main__":
    slow_disk(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))

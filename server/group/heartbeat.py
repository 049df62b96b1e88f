"""What a rank started by ``trainwire serve --nproc N`` does first: tie its life to the
supervisor's and start its heartbeat.

The supervisor starts its ranks without running any code in the child between fork and exec
(a ``preexec_fn`` is unsafe in a process that runs threads, and one that deadlocks there never
reaches exec), so each rank arms Linux's parent-death signal on itself, first thing, and then
checks that its parent is still the supervisor: one that died in between sent no signal.

The heartbeat is a thread that counts on the group's board (``board``) every ``interval`` while
this process runs at all. A rank that is stopped (SIGSTOP, a frozen cgroup) or wedged so hard
that no Python runs (a call that holds the interpreter) falls silent, and the supervisor takes
the group down once the silence passes the stall bound (``--rank-stall-timeout-s``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from trainwire.server.group.board import BOARD_ENV, GroupBoard

logger = logging.getLogger(__name__)

SUPERVISOR_ENV = "TRAINWIRE_SUPERVISOR_PID"  # set by the supervisor for the ranks it starts
DEFAULT_RANK_STALL_TIMEOUT_S = 60.0
BEATS_PER_BOUND = 10  # heartbeats within one stall bound, at most one a second
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
SUPERVISOR_GONE_EXIT = 1


def beat_interval_s(stall_timeout_s: float) -> float:
    return min(1.0, stall_timeout_s / BEATS_PER_BOUND)


def start_rank_watch(
    stall_timeout_s: float, environ: Mapping[str, str] = os.environ
) -> GroupBoard | None:
    """In a rank the supervisor started: die with the supervisor and start the heartbeat; the
    board (None in any other process: a plain ``trainwire serve``, a torchrun rank)."""
    supervisor = environ.get(SUPERVISOR_ENV)
    if supervisor is None:
        return None
    die_with_parent(int(supervisor))
    board = GroupBoard(Path(environ[BOARD_ENV]), int(environ["WORLD_SIZE"]))
    rank = int(environ["RANK"])
    interval = beat_interval_s(stall_timeout_s)
    threading.Thread(
        target=_beat, args=(board, rank, interval), name="trainwire-heartbeat", daemon=True
    ).start()
    return board


def die_with_parent(supervisor_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere a no-op), and exit now if
    the parent is already not ``supervisor_pid``: it died before the signal was armed."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != supervisor_pid:
        logger.error("the supervisor (pid %d) is gone: this rank exits", supervisor_pid)
        logging.shutdown()
        os._exit(SUPERVISOR_GONE_EXIT)


def _beat(board: GroupBoard, rank: int, interval: float) -> None:
    while True:  # as long as the process lives (a daemon thread)
        board.beat(rank)
        time.sleep(interval)

"""``trainwire serve --nproc N``: start N rank processes on this node and keep them a group.

Each rank is ``python -m trainwire`` with the same arguments and the environment torchrun would
give it (``launch.LAUNCH_VARIABLES``), so a node served this way and one started by torchrun run
the same code. The supervisor itself holds nothing of the session: no port, no state directory.

A rank that exits while the server is not stopping takes the group down: the supervisor kills
the rest (SIGKILL: a rank may be blocked in a collective that will never complete; nothing is
lost, since every answered operation is in the journal) and starts a new group on a new
rendezvous port. Its rank 0 recovers from the latest checkpoint and the journal, as a restarted
single-process server does; clients retry meanwhile. So does a rank that stops making progress
without exiting (SIGSTOP, a wedge that runs no Python): every rank counts heartbeats on the
group's board (``board``, ``heartbeat``), and one silent past ``rank_stall_timeout_s`` is taken
for failed. A rank 0 that exits with the usage-error code (2: a bad option, a missing model
root) would fail the same way again, so the supervisor stops with it at once; a group that
keeps failing before it has served for ``quick_failure_s`` (a model that cannot load, a port
taken, a rank that dies while a large model loads, however long that takes: a group counts as
serving only once rank 0 marks it ready) is given up after ``max_quick_failures`` tries in a
row. Either way a broken setup ends with its error rather than a loop.

A listener given port 0 is pinned to one free port before the first group starts, so a restarted
group listens where the first did.

SIGTERM or SIGINT to the supervisor is passed to rank 0, which stops gracefully (the operation
in flight finishes and commits) and then tells the other ranks to exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainwire.server.group.board import BOARD_ENV, GroupBoard, Silence
from trainwire.server.group.heartbeat import DEFAULT_RANK_STALL_TIMEOUT_S, SUPERVISOR_ENV

logger = logging.getLogger(__name__)

QUICK_FAILURE_S = 30.0
MAX_QUICK_FAILURES = 5
USAGE_ERROR_EXIT = 2  # the CLI's code for a user's mistake (trainwire.cli.USAGE_ERROR)
LEADER_EXIT_WAIT_S = 2.0  # how long a failed group waits for rank 0's own exit code
POLL_S = 0.1
STOP_WAIT_S = 10.0  # after rank 0 has stopped, how long the others may take to follow
# A rank's first heartbeat comes once its interpreter runs the CLI's first lines: under load
# that can take longer than a small stall bound, so before it the bound is at least this.
FIRST_BEAT_S = 30.0


@dataclass(frozen=True)
class Failure:
    """Why a group is taken down: a rank that exited (its code) or fell silent (``stalled``)."""

    rank: int
    code: int | None = None
    stalled_s: float | None = None

    def __str__(self) -> str:
        if self.stalled_s is not None:
            return f"rank {self.rank} was not heard of for {self.stalled_s:.1f} s"
        return f"rank {self.rank} exited with code {self.code}"


class GroupSupervisor:
    """Starts, watches and restarts the ranks of one node's group."""

    def __init__(
        self,
        argv: Sequence[str],
        nproc: int,
        stop_grace_s: float,
        *,
        rank_stall_timeout_s: float = DEFAULT_RANK_STALL_TIMEOUT_S,
        max_quick_failures: int = MAX_QUICK_FAILURES,
        quick_failure_s: float = QUICK_FAILURE_S,
    ) -> None:
        self.argv = pin_listen_ports(argv)
        self.nproc = nproc
        self.stop_grace_s = stop_grace_s
        self.rank_stall_timeout_s = rank_stall_timeout_s
        self.max_quick_failures = max_quick_failures
        self.quick_failure_s = quick_failure_s
        self.stopping = threading.Event()
        self.restarts = 0
        self._ranks: list[subprocess.Popen[bytes]] = []
        self._boards = Path(tempfile.mkdtemp(prefix="trainwire-group-"))
        self._board: GroupBoard | None = None
        self._ready_at: float | None = None  # when the current group was first seen ready

    def run(self) -> int:
        """Keep a group running until asked to stop; the exit code of the whole command."""
        try:
            return self._supervise()
        finally:
            shutil.rmtree(self._boards, ignore_errors=True)

    def _supervise(self) -> int:
        quick_failures = 0
        while not self.stopping.is_set():
            started = time.monotonic()
            self._start()
            failed = self._watch()
            if failed is None:
                return self._stop()
            if failed.stalled_s is None and self._leader_refused_its_arguments():
                self._kill_all()
                logger.error("rank 0 refused its arguments (see its error above)")
                return USAGE_ERROR_EXIT
            served_s = self._served_s()
            self._kill_all()
            lived = time.monotonic() - started
            quick_failures = quick_failures + 1 if served_s < self.quick_failure_s else 0
            if quick_failures >= self.max_quick_failures:
                logger.error(
                    "%s; the group failed %d times in a row before it had served for %.0f s: "
                    "giving up (see the ranks' errors above)",
                    failed,
                    quick_failures,
                    self.quick_failure_s,
                )
                return 1
            self.restarts += 1
            logger.warning(
                "%s after %.1f s: restarting the group (restart %d); rank 0 recovers from the "
                "latest checkpoint and journal",
                failed,
                lived,
                self.restarts,
            )
            self.stopping.wait(min(2.0**quick_failures, 30.0) if quick_failures else 0.0)
        return 0  # asked to stop between two groups: nothing is running

    def _start(self) -> None:
        port = _free_port()
        board = GroupBoard.create(self._boards / f"board-{self.restarts}", self.nproc)
        ranks = []
        for rank in range(self.nproc):
            environ = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.nproc),
                "LOCAL_WORLD_SIZE": str(self.nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": self._threads_per_rank(),
                BOARD_ENV: str(board.path),
                SUPERVISOR_ENV: str(os.getpid()),
            }
            # Its own session: a terminal's Ctrl-C reaches the supervisor alone, which stops
            # the ranks in order rather than all at once. No code runs in the child before
            # exec (this process may run threads): each rank arms its parent-death signal
            # itself, first thing (``heartbeat``).
            process = subprocess.Popen(
                [sys.executable, "-m", "trainwire", *self.argv],
                env=environ,
                start_new_session=True,
            )
            ranks.append(process)
        self._ranks = ranks  # whole: a reader never sees half a group
        self._board, self._ready_at = board, None
        pids = ", ".join(f"rank {r}: {p.pid}" for r, p in enumerate(ranks))
        logger.info("started %d ranks (%s), rendezvous port %d", self.nproc, pids, port)

    def ranks_started(self) -> list[int]:
        """The process ids of the current group's ranks, in rank order (empty before a start)."""
        return [process.pid for process in self._ranks]

    @property
    def ready(self) -> bool:
        """Whether the current group's rank 0 has served (recovered and taking operations)."""
        board = self._board
        try:
            return board is not None and board.ready
        except ValueError:  # the group was taken down meanwhile (its board closed)
            return False

    def _threads_per_rank(self) -> str:
        """The ranks share the node's cores: each gets its share of CPU threads (torchrun gives
        each one) unless OMP_NUM_THREADS says otherwise. The thread count is part of what a CPU
        computation's bits depend on, so it is fixed for a run, never left to chance."""
        given = os.environ.get("OMP_NUM_THREADS")
        return given or str(max(1, (os.cpu_count() or 1) // self.nproc))

    def _watch(self) -> Failure | None:
        """Wait until a rank exits or falls silent past the stall bound (why), or a stop is
        asked for (None)."""
        assert self._board is not None
        silence = Silence(
            self._board, first_beat_s=max(0.0, FIRST_BEAT_S - self.rank_stall_timeout_s)
        )
        while not self.stopping.wait(POLL_S):
            for rank, process in enumerate(self._ranks):
                code = process.poll()
                if code is not None:
                    return Failure(rank, code=code)
            if self._ready_at is None and self._board.ready:
                self._ready_at = time.monotonic()
            silence.update()
            rank, silent_s = silence.longest()
            if silent_s > self.rank_stall_timeout_s:
                logger.error(
                    "rank %d has not been heard of for %.1f s (--rank-stall-timeout-s %g): it "
                    "has stopped making progress; taking the group down",
                    rank,
                    silent_s,
                    self.rank_stall_timeout_s,
                )
                return Failure(rank, stalled_s=silent_s)
        return None

    def _served_s(self) -> float:
        """How long the failed group served (0 if it never became ready)."""
        return 0.0 if self._ready_at is None else time.monotonic() - self._ready_at

    def _leader_refused_its_arguments(self) -> bool:
        """Whether rank 0 exited with the usage-error code. When another rank noticed first
        (rank 0's refusal closed the group under it), rank 0 is given a moment to finish."""
        try:
            return self._ranks[0].wait(LEADER_EXIT_WAIT_S) == USAGE_ERROR_EXIT
        except subprocess.TimeoutExpired:
            return False

    def _stop(self) -> int:
        """Rank 0 stops gracefully and releases the others; stragglers are killed."""
        leader = self._ranks[0]
        if leader.poll() is None:
            leader.send_signal(signal.SIGTERM)
        try:
            code = leader.wait(self.stop_grace_s + STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("rank 0 did not stop within %.0f s: killing it", self.stop_grace_s)
            code = None
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self._ranks[1:]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        return 0 if code == 0 else 1

    def _kill_all(self) -> None:
        for process in self._ranks:
            if process.poll() is None:
                process.kill()
        for process in self._ranks:
            process.wait()
        if self._board is not None:
            self._board.remove()
            self._board = None


def supervise(
    argv: Sequence[str], nproc: int, stop_grace_s: float, rank_stall_timeout_s: float
) -> int:
    """Run ``GroupSupervisor`` until SIGTERM or SIGINT; its exit code."""
    supervisor = GroupSupervisor(
        argv, nproc, stop_grace_s, rank_stall_timeout_s=rank_stall_timeout_s
    )

    def on_signal(signum: int, frame: object) -> None:
        logger.info("%s received: stopping the group", signal.Signals(signum).name)
        supervisor.stopping.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return supervisor.run()


LISTEN_OPTIONS = ("--listen", "--tinker-listen")


def pin_listen_ports(argv: Sequence[str]) -> list[str]:
    """``argv`` with each listener's port 0 replaced by a port free now, chosen once.

    Port 0 asks for any free port; every restarted group would then listen on another one, and
    a client retrying the old address would never find the server again. Chosen here, once,
    every group the supervisor starts listens where the first one did.
    """
    pinned = list(argv)
    for index, item in enumerate(pinned):
        for option in LISTEN_OPTIONS:
            if item == option and index + 1 < len(pinned):
                pinned[index + 1] = _pinned(pinned[index + 1])
            elif item.startswith(option + "="):
                pinned[index] = f"{option}={_pinned(item.split('=', 1)[1])}"
    return pinned


def _pinned(listen: str) -> str:
    host, _, port = listen.rpartition(":")
    if port != "0":
        return listen
    return f"{host}:{_free_port(host.strip('[]') or '127.0.0.1')}"


def _free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` free now (its user binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])

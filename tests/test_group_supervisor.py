"""``trainwire serve --nproc N``'s supervisor gives up on a setup that cannot work, rather than
restarting it forever: a rank's usage error ends it at once with that code, and a group that
keeps dying before it has served ends it after ``max_quick_failures`` tries. Its ranks go with
it, and a rank whose supervisor is already gone does not start. (Restarting a group whose rank
died or stopped mid-run is tests/test_sharded_serve.py's.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainwire.server.group.board import BOARD_ENV, GroupBoard
from trainwire.server.group.heartbeat import SUPERVISOR_ENV, SUPERVISOR_GONE_EXIT
from trainwire.server.group.supervisor import USAGE_ERROR_EXIT, GroupSupervisor
from trainwire.testing import free_port


def serve_argv(state: Path, *extra: str) -> list[str]:
    return ["serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--nproc", "2", *extra]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_ranks_usage_error_ends_the_supervisor_with_it(tmp_path):
    argv = serve_argv(tmp_path / "state", "--model-root", str(tmp_path / "missing"))
    started = time.monotonic()
    assert GroupSupervisor(argv, 2, stop_grace_s=5.0).run() == USAGE_ERROR_EXIT
    assert time.monotonic() - started < 60, "no restarts"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_group_that_dies_right_after_starting_is_given_up(tmp_path):
    supervisor = GroupSupervisor(
        serve_argv(tmp_path / "state"), 2, stop_grace_s=5.0, max_quick_failures=1
    )
    result: list[int] = []
    # A daemon, stopped in any case: a failed test must not leave a group running behind it.
    thread = threading.Thread(target=lambda: result.append(supervisor.run()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(supervisor.ranks_started()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(supervisor.ranks_started()[1], signal.SIGKILL)
        thread.join(60)
    finally:
        supervisor.stopping.set()
        thread.join(30)
    assert result == [1] and supervisor.restarts == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_group_that_dies_while_it_starts_is_given_up_however_long_its_start_takes(tmp_path):
    """A group counts as having lived only once rank 0 served: one that dies every time past
    the quick-failure window but before it is ready (a large model still loading) is given
    up, not restarted forever."""
    supervisor = GroupSupervisor(
        serve_argv(tmp_path / "state"),
        2,
        stop_grace_s=5.0,
        max_quick_failures=2,
        quick_failure_s=QUICK_FAILURE_WINDOW_S,
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()), daemon=True)
    thread.start()
    try:
        killed: list[int] = []
        for _ in range(2):
            ranks = wait_for_a_new_group(supervisor, killed)
            started = time.monotonic()
            while time.monotonic() - started < 2 * QUICK_FAILURE_WINDOW_S:
                time.sleep(0.05)  # the group is older than the window now
            assert not supervisor.ready, "the group served before it was killed: no case"
            os.kill(ranks[1], signal.SIGKILL)
            killed += ranks
        thread.join(60)
    finally:
        supervisor.stopping.set()
        thread.join(30)
    assert result == [1] and supervisor.restarts == 1


QUICK_FAILURE_WINDOW_S = 0.2


def wait_for_a_new_group(supervisor: GroupSupervisor, old: list[int]) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = supervisor.ranks_started()
        if len(ranks) == 2 and not set(ranks) & set(old):
            return ranks
        time.sleep(0.05)
    raise AssertionError("no new group was started")


def test_a_listener_on_port_0_is_pinned_once_so_a_restarted_group_listens_where_it_did():
    argv = ["serve", "--listen", "127.0.0.1:0", "--tinker-listen=127.0.0.1:0", "--nproc", "2"]
    supervisor = GroupSupervisor(argv, 2, stop_grace_s=5.0)
    listen, tinker = supervisor.argv[2], supervisor.argv[3]
    assert listen.startswith("127.0.0.1:") and not listen.endswith(":0")
    assert tinker.startswith("--tinker-listen=127.0.0.1:") and not tinker.endswith(":0")
    assert supervisor.argv[4:] == ["--nproc", "2"]
    given = ["serve", "--listen", "127.0.0.1:50051"]
    assert GroupSupervisor(given, 2, stop_grace_s=5.0).argv == given


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_ranks_die_with_a_sigkilled_supervisor(tmp_path):
    """SIGKILL leaves the supervisor no time to stop its ranks: they go with it (the parent-death
    signal), so no orphan keeps the port or the state directory from the next server."""
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "trainwire", *serve_argv(tmp_path / "state")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children = Path(f"/proc/{supervisor.pid}/task/{supervisor.pid}/children")
    deadline = time.monotonic() + 60
    ranks: list[int] = []
    while len(ranks) < 2 and time.monotonic() < deadline:
        ranks = [int(pid) for pid in children.read_text().split()]
        time.sleep(0.05)
    assert len(ranks) == 2
    supervisor.kill()
    supervisor.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid in ranks if alive(pid)]
    for pid in survivors:  # the test fails; nothing of it is left running
        os.kill(pid, signal.SIGKILL)
    assert not survivors


@pytest.mark.timeout(120)
def test_a_rank_whose_supervisor_died_before_it_started_exits_at_once(tmp_path):
    """The rank arms its parent-death signal itself (the supervisor runs no code in the child
    before exec); a supervisor that died before that sent no signal, so the rank checks its
    parent and leaves without touching the state directory."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a supervisor that is no longer there
    board = tmp_path / "board"
    GroupBoard.create(board, 2).close()
    environ = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               BOARD_ENV: str(board), SUPERVISOR_ENV: str(gone.pid)}  # fmt: skip
    state = tmp_path / "state"
    rank = subprocess.Popen(
        [sys.executable, "-m", "trainwire", *serve_argv(state)],
        env=environ,
        stderr=subprocess.PIPE,
    )
    try:
        _, err = rank.communicate(timeout=60)
    finally:
        rank.kill()
    assert rank.returncode == SUPERVISOR_GONE_EXIT
    assert f"the supervisor (pid {gone.pid}) is gone" in err.decode()
    assert not state.exists()


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, reaped by init later, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False

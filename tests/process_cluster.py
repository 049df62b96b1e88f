"""A real ``trainwire serve`` and a real ``trainwire run`` as processes, restartable and killable,
and where their files say they are (journal, cursor, checkpoints being written).

Shared by the chaos test (one server process) and the sharded serving test (a supervisor and its
rank processes): each kills processes at chosen moments and checks the run still ends with the
uninterrupted run's bits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ledger_files import journal_lineage, journal_position

from trainwire.testing import free_port, wait_for_listener

RUN_ID = "chaos"
AIM_TIMEOUT_S = 60  # the longest wait for the moment a kill aims at


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class Cluster:
    """One server process and one controller process, restartable, killable."""

    def __init__(
        self,
        tmp: Path,
        model_root: Path,
        manifest: Path,
        *,
        window: int = 1,
        server_options: Sequence[str] = (),
        server_environment: Mapping[str, str] | None = None,
    ) -> None:
        self.state = tmp / "state"
        self.work = tmp / "work"
        self.logs = tmp / "logs"
        self.logs.mkdir()
        port = free_port()
        self.target = f"127.0.0.1:{port}"
        cli = [sys.executable, "-m", "trainwire"]
        self.server_args = [*cli, "serve", "--listen", self.target, "--state-dir", str(self.state),
                            "--model-root", str(model_root), "--device", "cpu",
                            *server_options]  # fmt: skip
        self.server_environment = server_environment
        self.controller_args = [*cli, "run", "--server", self.target, "--manifest", str(manifest),
                                "--run-id", RUN_ID, "--work-dir", str(self.work),
                                "--checkpoint-every", "2", "--window", str(window),
                                "--quiet"]  # fmt: skip
        self.server: subprocess.Popen | None = None
        self.controller: subprocess.Popen | None = None
        self.starts = 0

    def _start(
        self, args: list[str], name: str, environment: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        self.starts += 1
        log = open(self.logs / f"{name}-{self.starts}.log", "wb")  # noqa: SIM115 - kept by Popen
        env = None if environment is None else {**os.environ, **environment}
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_server(self) -> None:
        self.server = self._start(self.server_args, "server", self.server_environment)

    def rank_pids(self) -> dict[int, int]:
        """``trainwire serve --nproc N``'s rank processes, by rank: the server's children, each
        known by the RANK its supervisor gave it (Linux's /proc)."""
        assert self.server is not None
        children = Path(f"/proc/{self.server.pid}/task/{self.server.pid}/children")
        ranks = {}
        for pid in children.read_text().split():
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                for entry in environ:
                    if entry.startswith(b"RANK="):
                        ranks[int(entry[5:])] = int(pid)
        return ranks

    def start_controller(self) -> None:
        if not (self.work / "cursor.json").exists():
            # A controller fails at once on a server it never reached; one with a cursor met
            # its server and waits for it (the restarts these tests make).
            wait_for_listener(self.target)
        self.controller = self._start(self.controller_args, "controller")

    @staticmethod
    def kill(process: subprocess.Popen | None) -> None:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def journal_position(self) -> int:
        return journal_position(self.state, RUN_ID)

    def cursor_position(self) -> int:
        try:
            return json.loads((self.work / "cursor.json").read_text())["position"]
        except (OSError, ValueError, KeyError):
            return 0

    def checkpoints_in_flight(self) -> set[str]:
        """The hidden directories of checkpoints being written (or left by a killed writer)."""
        folder = self.state / "runs" / RUN_ID / "checkpoints"
        try:
            return {p.name for p in folder.iterdir() if p.name.startswith(".")}
        except FileNotFoundError:
            return set()

    def journal_lineage(self) -> list[tuple[int, str]]:
        return journal_lineage(self.state, RUN_ID)

    def logs_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.logs.iterdir())
        )


# A run is failed only once it stops moving: neither its journal nor any process's log changed
# for this long (a hang), however long a loaded machine takes to finish it.
STALL_S = 120


def progress(cluster: Cluster) -> tuple[int, int]:
    """What moves while a run makes progress: its journal's lineage and its processes' logs."""
    try:
        applied = len(cluster.journal_lineage())
    except sqlite3.Error:  # not created yet, or a restart holds it
        applied = -1
    logged = sum(path.stat().st_size for path in cluster.logs.iterdir())
    return applied, logged


def wait_for_controller(cluster: Cluster, context: str = "") -> None:
    """Until the controller exits; fails the test once the run stalls for ``STALL_S``."""
    seen, moved = progress(cluster), time.monotonic()
    while cluster.controller is not None and cluster.controller.poll() is None:
        if (now := progress(cluster)) != seen:
            seen, moved = now, time.monotonic()
        assert time.monotonic() - moved < STALL_S, f"stalled: {context}\n{cluster.logs_text()}"
        time.sleep(0.1)


def wait_until(condition, timeout_s: float = AIM_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return False


def kill_at_position(cluster: Cluster, which: str, ahead: int) -> str:
    """Kill the server once its journal, or the controller once its cursor, is ``ahead``
    operations further than now."""
    if which == "server":
        position, process, restart = cluster.journal_position, "server", cluster.start_server
    else:
        position, process, restart = cluster.cursor_position, "controller", cluster.start_controller
    aim = position() + ahead
    reached = wait_until(lambda: position() >= aim)
    assert reached, f"{which} never reached position {aim}\n{cluster.logs_text()}"
    cluster.kill(getattr(cluster, process))
    landed = position()  # the dead process's files: where the kill really fell
    restart()
    assert landed >= aim
    return f"{which} at position {landed} (aimed at {aim})"

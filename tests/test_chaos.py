"""Chaos: real `trainwire serve` and `trainwire run` processes, SIGKILLed at chosen moments.

Each seed kills the server and the controller several times each, in a seeded order: while a
checkpoint is being written, between an operation's commit and the cursor write, and once the
journal or the cursor reaches a seeded position. Both are restarted every time. Every kill is
checked to have landed where it was aimed (on the dead process's files, which no longer move),
and the run must still end with the uninterrupted run's digest and export files, with the
journal's final lineage holding each operation exactly once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plans import sentiment_plan

from trainwire.client import ManagedTrainingPlan, write_manifest
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import free_port

RUN_ID = "chaos"
RUN_TIMEOUT_S = 240
AIM_TIMEOUT_S = 60  # the longest wait for the moment a kill aims at
KILL_ATTEMPTS = 5  # what a kill aims at can pass between being seen and the kill


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class Cluster:
    """One server process and one controller process, restartable, killable."""

    def __init__(self, tmp: Path, model_root: Path, manifest: Path, *, window: int = 1) -> None:
        self.state = tmp / "state"
        self.work = tmp / "work"
        self.logs = tmp / "logs"
        self.logs.mkdir()
        port = free_port()
        self.target = f"127.0.0.1:{port}"
        cli = [sys.executable, "-m", "trainwire"]
        self.server_args = [*cli, "serve", "--listen", self.target, "--state-dir", str(self.state),
                            "--model-root", str(model_root), "--device", "cpu"]  # fmt: skip
        self.controller_args = [*cli, "run", "--server", self.target, "--manifest", str(manifest),
                                "--run-id", RUN_ID, "--work-dir", str(self.work),
                                "--checkpoint-every", "2", "--window", str(window),
                                "--quiet"]  # fmt: skip
        self.server: subprocess.Popen | None = None
        self.controller: subprocess.Popen | None = None
        self.starts = 0

    def _start(self, args: list[str], name: str) -> subprocess.Popen:
        self.starts += 1
        log = open(self.logs / f"{name}-{self.starts}.log", "wb")  # noqa: SIM115 - kept by Popen
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def start_server(self) -> None:
        self.server = self._start(self.server_args, "server")

    def start_controller(self) -> None:
        self.controller = self._start(self.controller_args, "controller")

    @staticmethod
    def kill(process: subprocess.Popen | None) -> None:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def journal_position(self) -> int:
        path = self.state / "runs" / RUN_ID / "journal.sqlite3"
        if not path.exists():
            return 0
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            try:
                row = db.execute(
                    "SELECT MAX(position) FROM operations WHERE rolled_back = 0"
                ).fetchone()
            except sqlite3.Error:
                return 0
        return row[0] or 0

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
        path = self.state / "runs" / RUN_ID / "journal.sqlite3"
        with contextlib.closing(sqlite3.connect(path)) as db:
            return db.execute(
                "SELECT position, operation_key FROM operations WHERE rolled_back = 0 "
                "ORDER BY position"
            ).fetchall()

    def logs_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.logs.iterdir())
        )


def wait_until(condition, timeout_s: float = AIM_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return False


def kill_server_during_checkpoint(cluster: Cluster) -> str:
    """Kill the server while it writes a new checkpoint; the dead server's half-written
    directory shows that it did (a checkpoint that finished first is tried again)."""
    left_before = cluster.checkpoints_in_flight()  # by earlier kills: not this checkpoint
    for attempt in range(1, KILL_ATTEMPTS + 1):
        # A checkpoint that finished leaves nothing behind, so left_before stays what it was.
        started = wait_until(lambda: cluster.checkpoints_in_flight() - left_before)
        assert started, f"no checkpoint began within {AIM_TIMEOUT_S}s\n{cluster.logs_text()}"
        cluster.kill(cluster.server)
        half_written = cluster.checkpoints_in_flight() - left_before
        cluster.start_server()
        if half_written:
            return f"server during checkpoint {sorted(half_written)} (attempt {attempt})"
    pytest.fail(f"{KILL_ATTEMPTS} checkpoints finished before the kill reached them")


def kill_controller_after_commit(cluster: Cluster) -> str:
    """Kill the controller after an operation committed and before its cursor covers it; the
    dead controller's cursor shows that it did (a cursor that caught up first is tried again)."""
    for attempt in range(1, KILL_ATTEMPTS + 1):
        start = cluster.journal_position()

        def uncovered(start: int = start) -> bool:
            return cluster.journal_position() > max(start, cluster.cursor_position())

        assert wait_until(uncovered), f"no commit within {AIM_TIMEOUT_S}s\n{cluster.logs_text()}"
        cluster.kill(cluster.controller)
        journal, cursor = cluster.journal_position(), cluster.cursor_position()
        cluster.start_controller()
        if journal > cursor:
            return f"controller after commit {journal}, cursor at {cursor} (attempt {attempt})"
    pytest.fail(f"{KILL_ATTEMPTS} times the cursor caught up before the kill reached it")


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


@pytest.fixture(scope="module")
def chaos_plan(bert_classifier_config):
    return sentiment_plan(bert_classifier_config, examples=36, batch_size=4, num_epochs=2)


@pytest.fixture(scope="module")
def reference(chaos_plan, tmp_path_factory):
    """The uninterrupted run, in-process: its result and its best export's files."""
    tmp = tmp_path_factory.mktemp("reference")
    session = TrainingSession(chaos_plan.config, max_steps=chaos_plan.max_steps)
    training = ManagedTraining(session, chaos_plan, checkpoint_dir=tmp / "checkpoints")
    result = training.run()
    training.export_weights(tmp / "export")
    return result, file_hashes(tmp / "export")


def expected_operation_count(plan: ManagedTrainingPlan, result) -> int:
    updates = [r for r in result.history if r["kind"] == "update"]
    bests = [r for r in result.history if r["kind"] == "evaluation" and r["is_best"]]
    checkpoints = [r for r in updates if r["step"] % 2 == 0]
    return plan.batch_count + len(updates) + len(bests) + len(checkpoints) + 1  # + the export


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("seed", "window"), [(1, 1), (2, 1), (3, 1), (1, 3), (2, 3)])
def test_sigkilled_server_and_controller_end_bit_identical(
    seed, window, chaos_plan, reference, model_root, tmp_path
):
    expected, expected_export = reference
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, chaos_plan.to_manifest())
    cluster = Cluster(tmp_path, model_root, manifest, window=window)
    rng = random.Random(seed)
    # Two of each targeted kill first, then two of each positioned one; each in seeded order,
    # each positioned one aimed 1-3 operations ahead.
    targeted = rng.sample(["server-during-checkpoint", "controller-after-commit"] * 2, 4)
    positioned = [
        (which, rng.randint(1, 3)) for which in rng.sample(["server", "controller"] * 2, 4)
    ]
    cluster.start_server()
    cluster.start_controller()
    started = time.monotonic()
    landed = []
    try:
        for kill in targeted:
            if kill == "server-during-checkpoint":
                landed.append(kill_server_during_checkpoint(cluster))
            else:
                landed.append(kill_controller_after_commit(cluster))
        for which, ahead in positioned:
            landed.append(kill_at_position(cluster, which, ahead))
        while cluster.controller.poll() is None:
            assert time.monotonic() - started < RUN_TIMEOUT_S, cluster.logs_text()
            time.sleep(0.1)
        assert cluster.controller.returncode == 0, f"{landed}\n{cluster.logs_text()}"
    finally:
        cluster.kill(cluster.controller)
        cluster.kill(cluster.server)

    summary = json.loads((cluster.work / "training_summary.json").read_text())
    assert summary["state_digest"] == expected.state_digest
    assert summary["result"]["history"] == expected.history
    assert summary["result"]["best_checkpoint_path"] == "best"
    assert file_hashes(cluster.work / "export") == expected_export

    lineage = cluster.journal_lineage()
    positions = [position for position, _ in lineage]
    keys = [key for _, key in lineage]
    assert positions == list(range(1, len(lineage) + 1)), "one operation per position"
    assert len(set(keys)) == len(keys), "each key of the final lineage applied once"
    assert len(lineage) == expected_operation_count(chaos_plan, expected)
    assert all(key.startswith(f"{RUN_ID}/{chaos_plan.fingerprint}/") for key in keys)

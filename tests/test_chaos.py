"""Chaos: real `trainwire serve` and `trainwire run` processes, SIGKILLed at random moments.

Each seed kills the server and the controller several times each: at random times, while a
checkpoint is being written, and between an operation's commit and the cursor write. Both are
restarted every time. The run must still end with the uninterrupted run's digest and export
files, and the journal's final lineage must hold each operation exactly once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plans import sentiment_plan

from trainwire.client import ManagedTrainingPlan, write_manifest
from trainwire.server.managed import ManagedTraining
from trainwire.server.session import TrainingSession

RUN_ID = "chaos"
RUN_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class Cluster:
    """One server process and one controller process, restartable, killable."""

    def __init__(self, tmp: Path, model_root: Path, manifest: Path) -> None:
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
                                "--checkpoint-every", "2", "--quiet"]  # fmt: skip
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

    def checkpoint_in_flight(self) -> bool:
        folder = self.state / "runs" / RUN_ID / "checkpoints"
        return folder.is_dir() and any(p.name.startswith(".") for p in folder.iterdir())

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


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return False


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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkilled_server_and_controller_end_bit_identical(
    seed, chaos_plan, reference, model_root, tmp_path
):
    expected, expected_export = reference
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, chaos_plan.to_manifest())
    cluster = Cluster(tmp_path, model_root, manifest)
    rng = random.Random(seed)
    # Two of each targeted kill first, then random ones while the run lasts; each in seeded order.
    targeted = rng.sample(["server-during-checkpoint", "controller-after-commit"] * 2, 4)
    kills = targeted + rng.sample(["server-random", "controller-random"] * 2, 4)
    cluster.start_server()
    cluster.start_controller()
    started = time.monotonic()
    done = []
    try:
        for kill in kills:
            if cluster.controller.poll() is not None:
                break
            done.append(kill)
            if kill == "server-during-checkpoint":
                wait_until(cluster.checkpoint_in_flight, timeout_s=rng.uniform(3, 8))
                cluster.kill(cluster.server)
                cluster.start_server()
            elif kill == "controller-after-commit":
                wait_until(
                    lambda: cluster.journal_position() > cluster.cursor_position(),
                    timeout_s=rng.uniform(3, 8),
                )
                cluster.kill(cluster.controller)
                cluster.start_controller()
            else:
                time.sleep(rng.uniform(0.5, 4.0))
                if kill == "server-random":
                    cluster.kill(cluster.server)
                    cluster.start_server()
                else:
                    cluster.kill(cluster.controller)
                    cluster.start_controller()
        while cluster.controller.poll() is None:
            assert time.monotonic() - started < RUN_TIMEOUT_S, cluster.logs_text()
            time.sleep(0.1)
        assert cluster.controller.returncode == 0, cluster.logs_text()
        assert done[:4] == targeted, f"the run ended before the targeted kills: only {done}"
    finally:
        cluster.kill(cluster.controller)
        cluster.kill(cluster.server)

    summary = json.loads((cluster.work / "training_summary.json").read_text())
    assert summary["state_digest"] == expected.state_digest
    assert summary["result"]["history"] == expected.history
    assert summary["result"]["best_checkpoint"] == "best"
    assert file_hashes(cluster.work / "export") == expected_export

    lineage = cluster.journal_lineage()
    positions = [position for position, _ in lineage]
    keys = [key for _, key in lineage]
    assert positions == list(range(1, len(lineage) + 1)), "one operation per position"
    assert len(set(keys)) == len(keys), "each key of the final lineage applied once"
    assert len(lineage) == expected_operation_count(chaos_plan, expected)
    assert all(key.startswith(f"{RUN_ID}/{chaos_plan.fingerprint}/") for key in keys)

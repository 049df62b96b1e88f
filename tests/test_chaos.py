"""Chaos: real `trainwire serve` and `trainwire run` processes, SIGKILLed at chosen moments.

Each seed kills the server and the controller several times each, in a seeded order: while a
checkpoint is being written, between an operation's commit and the cursor write, and once the
journal or the cursor reaches a seeded position. Both are restarted every time. Every kill is
checked to have landed where it was aimed (on the dead process's files, which no longer move),
and the run must still end with the uninterrupted run's digest and export files, with the
journal's final lineage holding each operation exactly once.
"""

from __future__ import annotations

import json
import random

import pytest
from plans import sentiment_plan
from process_cluster import (
    AIM_TIMEOUT_S,
    RUN_ID,
    Cluster,
    file_hashes,
    kill_at_position,
    wait_for_controller,
    wait_until,
)

from trainwire.client import ManagedTrainingPlan, write_manifest
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession

KILL_ATTEMPTS = 5  # what a kill aims at can pass between being seen and the kill


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
    landed = []
    try:
        for kill in targeted:
            if kill == "server-during-checkpoint":
                landed.append(kill_server_during_checkpoint(cluster))
            else:
                landed.append(kill_controller_after_commit(cluster))
        for which, ahead in positioned:
            landed.append(kill_at_position(cluster, which, ahead))
        wait_for_controller(cluster, str(landed))
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

"""Four LoRA runs on one ``trainwire serve --max-runs 4`` process, each driven by its own
``trainwire run`` (pipelined, window 2), while the server is SIGKILLed at seeded moments and
restarted: every run ends with the digest and export files of the same run trained alone
in-process, and each run's journal holds every key of its final lineage once."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
from ledger_files import journal_lineage, journal_position
from plans import sentiment_plan
from process_cluster import STALL_S, Cluster, file_hashes, wait_until

from trainwire.client import LoraSettings, write_manifest
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import wait_for_listener

RUNS = 4


@pytest.fixture(scope="module")
def plans(bert_classifier_config):
    lora = LoraSettings(r=4, alpha=8)
    return [
        sentiment_plan(
            bert_classifier_config, examples=24, batch_size=4, num_epochs=1, seed=seed, lora=lora
        )
        for seed in range(1, RUNS + 1)
    ]


@pytest.fixture(scope="module")
def references(plans, tmp_path_factory):
    """Each run alone, in-process: its final digest and its best export's files."""
    out = []
    for index, plan in enumerate(plans):
        tmp = tmp_path_factory.mktemp(f"alone-{index}")
        session = TrainingSession(plan.config, max_steps=plan.max_steps)
        training = ManagedTraining(session, plan, checkpoint_dir=tmp / "checkpoints")
        result = training.run()
        training.export_weights(tmp / "export")
        out.append((result.state_digest, file_hashes(tmp / "export")))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [1, 2])
def test_four_runs_killed_together_each_end_bit_identical(
    seed, plans, references, model_root, tmp_path
):
    manifests = []
    for index, plan in enumerate(plans):
        manifests.append(tmp_path / f"manifest-{index}.json")
        write_manifest(manifests[-1], plan.to_manifest())
    cluster = Cluster(tmp_path, model_root, manifests[0], server_options=("--max-runs", "4"))
    run_ids = [f"run-{index}" for index in range(RUNS)]
    works = [tmp_path / f"work-{index}" for index in range(RUNS)]
    controllers: list[subprocess.Popen] = []
    rng = random.Random(seed)
    landed = []
    cluster.start_server()
    try:
        for run_id, manifest, work in zip(run_ids, manifests, works, strict=True):
            log = open(cluster.logs / f"{run_id}.log", "wb")  # noqa: SIM115 - kept by Popen
            command = [sys.executable, "-m", "trainwire", "run", "--server", cluster.target,
                       "--manifest", str(manifest), "--run-id", run_id, "--work-dir", str(work),
                       "--checkpoint-every", "2", "--window", "2", "--quiet"]  # fmt: skip
            if not controllers:
                wait_for_listener(cluster.target)  # a controller fails on a server never reached
            controllers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        # A controller that never reached its server fails at once, as it should: the kills
        # begin once every run committed there, however slowly a busy machine starts them.
        opened = wait_until(
            lambda: all(journal_position(cluster.state, r) >= 1 for r in run_ids), STALL_S
        )
        assert opened, cluster.logs_text()
        for _ in range(3):  # the server killed three times, each when a seeded run moved on
            run_id = rng.choice(run_ids)
            aim = journal_position(cluster.state, run_id) + rng.randint(1, 4)
            if not wait_until(lambda r=run_id, a=aim: journal_position(cluster.state, r) >= a):
                break  # that run finished first: the others were killed already or end now
            cluster.kill(cluster.server)
            landed.append(f"{run_id} at {journal_position(cluster.state, run_id)}")
            cluster.start_server()
        deadline = time.monotonic() + STALL_S * 4
        while any(c.poll() is None for c in controllers):
            assert time.monotonic() < deadline, f"{landed}\n{cluster.logs_text()}"
            time.sleep(0.2)
        assert [c.returncode for c in controllers] == [0] * RUNS, f"{landed}\n{cluster.logs_text()}"
    finally:
        for controller in controllers:
            cluster.kill(controller)
        cluster.kill(cluster.server)

    assert landed, "no kill landed"
    for index, (digest, export) in enumerate(references):
        summary = json.loads((works[index] / "training_summary.json").read_text())
        assert summary["state_digest"] == digest, (index, landed)
        assert file_hashes(works[index] / "export") == export, (index, landed)
        lineage = journal_lineage(cluster.state, run_ids[index])
        keys = [key for _, key in lineage]
        assert [p for p, _ in lineage] == list(range(1, len(lineage) + 1))
        assert len(set(keys)) == len(keys), "each key of the final lineage applied once"

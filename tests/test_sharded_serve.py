"""``trainwire serve --nproc 2``: one session on two CPU ranks behind the real server, exactly once.

The reference is the same plan run uninterrupted in-process on two ranks (``sharded_runs``'
``managed_run``: ``ManagedTraining`` on a sharded ``TrainingSession``). A real ``trainwire run``
drives a real ``trainwire serve --nproc 2`` through the same plan while rank 1, rank 0 and the
controller are SIGKILLed at seeded moments (the supervisor restarts the group after a rank's
death; the controller is restarted by the test): it must end with the reference's state digest,
history and export files, the journal's final lineage holding each operation once. So must a
run whose ranks are SIGSTOPped and left stopped (the supervisor takes a silent rank for failed
at ``--rank-stall-timeout-s``; rank 0 says NOT_SERVING meanwhile), and the same run,
uninterrupted, served by two torchrun agents of one rank each, as two pods of deploy/multi-pod/
run it. The interrupted runs train full weights (they share one reference), the other a LoRA
adapter with dropout (the ranks' RNG takes part); each test costs a minute or two.

Both sides run each rank on one CPU thread (``OMP_NUM_THREADS=1``): a CPU computation's bits
depend on its thread count, and the reference's ranks run on one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import sharded_workers as workers
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_cluster import Cluster, file_hashes, wait_for_controller, wait_until

from trainwire.client import LoraSettings, ManagedTrainingPlan, write_manifest
from trainwire.testing import free_port, tiny_text_examples

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
MODES = {"full": None, "lora": LoraSettings(r=4, alpha=8, dropout=0.1)}
# A stopped rank is taken for failed after this many seconds (health NOT_SERVING from half).
STALL_S = "6"


@pytest.fixture(scope="module")
def served_plan(request, llama_config, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A causal-lm plan (two epochs of 10 texts in microbatches of 3, an update every two),
    full or LoRA with dropout; its manifest, and the in-process two-rank run of it."""
    plan = ManagedTrainingPlan(
        tiny_text_examples(10),
        llama_config(
            lora=MODES[request.param],
            gradient_accumulation_steps=2,
            num_epochs=2,
            lr_scheduler="constant",
        ),
    )
    folder = tmp_path_factory.mktemp(f"sharded-serve-{request.param}")
    manifest = folder / "manifest.json"
    write_manifest(manifest, plan.to_manifest())
    out = folder / "reference"
    report = workers.launch(2, "managed_run", {"manifest": str(manifest), "out": str(out)})[0]
    report["export"] = file_hashes(out / "export")
    report["operations"] = _operation_count(plan, report["history"])
    return manifest, report


def _operation_count(plan: ManagedTrainingPlan, history: list[dict[str, Any]]) -> int:
    """Microbatches, updates, the checkpoints ``--checkpoint-every 2`` writes, the export."""
    updates = [record for record in history if record["kind"] == "update"]
    checkpoints = [record for record in updates if record["step"] % 2 == 0]
    return plan.batch_count + len(updates) + len(checkpoints) + 1


def _sharded_cluster(tmp_path: Path, model_root: Path, manifest: Path, *options: str) -> Cluster:
    return Cluster(
        tmp_path,
        model_root,
        manifest,
        server_options=["--nproc", "2", *options],
        server_environment=ONE_THREAD,
    )


def _finish(cluster: Cluster, landed: list[str]) -> None:
    wait_for_controller(cluster, str(landed))
    assert cluster.controller.returncode == 0, f"{landed}\n{cluster.logs_text()}"


def _assert_equals_reference(cluster: Cluster, reference: dict[str, Any]) -> None:
    summary = json.loads((cluster.work / "training_summary.json").read_text())
    assert summary["state_digest"] == reference["state_digest"]
    assert summary["result"]["history"] == reference["history"]
    assert file_hashes(cluster.work / "export") == reference["export"]
    lineage = cluster.journal_lineage()
    keys = [key for _, key in lineage]
    assert [position for position, _ in lineage] == list(range(1, len(lineage) + 1))
    assert len(set(keys)) == len(keys), "each key of the final lineage applied once"
    assert len(lineage) == reference["operations"]


def _kill_rank(cluster: Cluster, rank: int, ahead: int) -> str:
    """SIGKILL one rank once the journal is ``ahead`` operations further; the supervisor
    restarts the group (new rank processes) without the test's help."""
    aim = cluster.journal_position() + ahead
    reached = wait_until(lambda: cluster.journal_position() >= aim)
    assert reached, f"the journal never reached {aim}\n{cluster.logs_text()}"
    before = cluster.rank_pids()
    os.kill(before[rank], signal.SIGKILL)
    landed = cluster.journal_position()
    restarted = wait_until(
        lambda: (
            len(now := cluster.rank_pids()) == 2 and not set(now.values()) & set(before.values())
        )
    )
    assert restarted, f"the group was not restarted\n{cluster.logs_text()}"
    return f"rank {rank} at position {landed} (aimed at {aim})"


def _kill_controller(cluster: Cluster, ahead: int) -> str:
    aim = cluster.cursor_position() + ahead
    reached = wait_until(lambda: cluster.cursor_position() >= aim)
    assert reached, f"the cursor never reached {aim}\n{cluster.logs_text()}"
    cluster.kill(cluster.controller)
    landed = cluster.cursor_position()
    cluster.start_controller()
    return f"controller at position {landed} (aimed at {aim})"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("served_plan", "seed"), [("full", 1)], indirect=["served_plan"])
def test_sigkilled_ranks_and_controller_end_with_the_uninterrupted_two_rank_bits(
    seed, served_plan, model_root, tmp_path
):
    manifest, reference = served_plan
    rng = random.Random(seed)
    kills = rng.sample(["rank 1", "rank 0", "controller"], 3)
    cluster = _sharded_cluster(tmp_path, model_root, manifest)
    cluster.start_server()
    cluster.start_controller()
    landed: list[str] = []
    try:
        for kill in kills:
            ahead = rng.randint(1, 3)
            if kill == "controller":
                landed.append(_kill_controller(cluster, ahead))
            else:
                landed.append(_kill_rank(cluster, int(kill[-1]), ahead))
        _finish(cluster, landed)
    finally:
        cluster.kill(cluster.controller)
        cluster.kill(cluster.server)
    _assert_equals_reference(cluster, reference)


def _health(target: str) -> str:
    """The server's health as its status name; UNREACHABLE when it does not answer."""
    with grpc.insecure_channel(target) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def _stop_rank(cluster: Cluster, rank: int, moment: Callable[[], bool], what: str) -> str:
    """SIGSTOP one rank at ``moment`` and leave it stopped: the supervisor must notice the
    silence and restart the group (new rank processes) without the test's help. While rank 1
    is stopped, rank 0 must say NOT_SERVING before the group is restarted."""
    assert wait_until(moment), f"never {what}\n{cluster.logs_text()}"
    before = cluster.rank_pids()
    os.kill(before[rank], signal.SIGSTOP)
    landed = cluster.journal_position()
    if rank != 0:
        said = wait_until(lambda: _health(cluster.target) == "NOT_SERVING")
        assert said and cluster.rank_pids() == before, (
            f"rank 0 did not say NOT_SERVING while rank {rank} was stopped\n{cluster.logs_text()}"
        )
    restarted = wait_until(
        lambda: (
            len(now := cluster.rank_pids()) == 2 and not set(now.values()) & set(before.values())
        )
    )
    assert restarted, f"the group was not restarted\n{cluster.logs_text()}"
    return f"rank {rank} stopped {what} at position {landed}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("served_plan", ["full"], indirect=True)
def test_a_stopped_rank_is_taken_for_failed_and_the_run_ends_with_the_uninterrupted_bits(
    served_plan, model_root, tmp_path
):
    """SIGSTOP (a rank that stops making progress without exiting): rank 1 while a checkpoint
    is being written, then rank 0 while an operation is in flight, each left stopped."""
    manifest, reference = served_plan
    cluster = _sharded_cluster(tmp_path, model_root, manifest, "--rank-stall-timeout-s", STALL_S)
    cluster.start_server()
    cluster.start_controller()
    landed: list[str] = []
    try:
        saving = cluster.checkpoints_in_flight
        landed.append(_stop_rank(cluster, 1, lambda: bool(saving()), "while saving"))
        aim = cluster.journal_position() + 2
        moved = lambda: cluster.journal_position() >= aim  # noqa: E731 - the operation after it
        landed.append(_stop_rank(cluster, 0, moved, "in an operation"))
        _finish(cluster, landed)
    finally:
        cluster.kill(cluster.controller)
        cluster.kill(cluster.server)
    _assert_equals_reference(cluster, reference)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("served_plan", ["lora"], indirect=True)
def test_two_nodes_under_torchrun_serve_a_run_with_the_in_process_two_rank_bits(
    served_plan, model_root, tmp_path
):
    """Two torchrun agents with one rank each, as two pods of a LeaderWorkerSet run them
    (deploy/multi-pod/): global rank 0 serves, no --nproc."""
    manifest, reference = served_plan
    cluster = _sharded_cluster(tmp_path, model_root, manifest)
    serve = cluster.server_args[cluster.server_args.index("serve") :]
    serve = serve[: serve.index("--nproc")]
    rendezvous = str(free_port())
    nodes = []
    for node_rank in (0, 1):
        log = open(cluster.logs / f"node-{node_rank}.log", "wb")  # noqa: SIM115 - kept by Popen
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", "1", "--node-rank", str(node_rank),
                    "--master-addr", "127.0.0.1", "--master-port", rendezvous,
                    "--max-restarts", "0", "-m", "trainwire", *serve]  # fmt: skip
        environment = {**os.environ, **ONE_THREAD}
        nodes.append(
            subprocess.Popen(torchrun, stdout=log, stderr=subprocess.STDOUT, env=environment)
        )
    cluster.start_controller()
    try:
        _finish(cluster, [])
    finally:
        cluster.kill(cluster.controller)
        for node in nodes:
            node.terminate()  # torchrun passes it to its rank and exits with its own code
        for node in nodes:
            node.wait(60)
    _assert_equals_reference(cluster, reference)

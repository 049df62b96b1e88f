"""The session host without a network: open, exactly-once keys, positions, and the one
operation in flight (a shutdown lets it commit; the same key sent at once runs once).

Recovery after a restart is in test_host_recovery.py, name and path confinement in
test_host_confinement.py; the host fixtures (``make_host``, ``host``) are in conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
from fresh_state import fresh_info
from host_operations import BATCHES, op, run_ops
from service_fixtures import REVIEWS

from trainwire.contract import outcomes
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session.checkpoint import read_extra
from trainwire.server.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PositionMismatch,
    Unavailable,
)
from trainwire.server.grpc.servicer import config_from_json
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ExportWeightsRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    OptimStepRequest,
)


def test_open_is_idempotent_for_the_same_run_config_steps_and_plan(host, host_config):
    again = host.open("run", host_config, 10, "sha256:plan")

    assert again.created is False
    assert (again.run_id, again.state, again.position) == ("run", outcomes.OPEN, 0)
    assert again.config_fingerprint == host_config.fingerprint()
    assert (again.max_steps, again.plan_fingerprint) == (10, "sha256:plan")
    # A plain open(run_id, config), naming no steps or plan, accepts the open run's.
    plain = host.open("run", host_config, None, "")
    assert plain.created is False and plain.max_steps == 10


@pytest.mark.parametrize(
    ("run_id", "changes", "max_steps", "plan", "match"),
    [
        ("other", {}, 10, "sha256:plan", "open for run 'run', not 'other'"),
        ("run", {"learning_rate": 0.5}, 10, "sha256:plan", "learning_rate: open 0.001, req"),
        ("run", {}, 11, "sha256:plan", r"max_steps \(open 10, requested 11\)"),
        ("run", {}, 10, "sha256:other", "plan fingerprint"),
    ],
)
def test_open_refuses_another_run_config_steps_or_plan_naming_the_difference(
    host, host_config, run_id, changes, max_steps, plan, match
):
    requested = host_config.replace(**changes)

    with pytest.raises(FailedPrecondition, match=match):
        host.open(run_id, requested, max_steps, plan)


def test_open_refuses_bad_configs_as_invalid_arguments(make_host, host_config):
    host = make_host()
    fp16 = dict(host_config.to_dict(), precision="fp16")
    misspelled = dict(host_config.to_dict(), learning_rat=1)

    with pytest.raises(InvalidArgument, match="fp16 is not supported"):
        host.open("run", config_from_json(json.dumps(fp16)), 10)
    with pytest.raises(InvalidArgument, match="unknown config key"):
        host.open("run", config_from_json(json.dumps(misspelled)), 10)
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        host.open("run", config_from_json("{"), 10)
    with pytest.raises(InvalidArgument, match="run id name 'a/b' is not allowed"):
        host.open("a/b", host_config, 10)
    assert host.info().state == outcomes.IDLE
    assert not (host.state_dir.root / "runs" / "run").exists()


def test_operations_before_open_are_failed_precondition(make_host):
    host = make_host()

    with pytest.raises(FailedPrecondition, match="call Open first"):
        host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("k"))
    with pytest.raises(FailedPrecondition, match="call Open first"):
        host.apply(ops.FORWARD, ForwardRequest(BATCHES[0]))


def test_a_retried_key_returns_the_recorded_result_without_running_again(host):
    first = host.apply(
        ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("k1", 0, digest=True)
    )
    host.apply(ops.OPTIM_STEP, OptimStepRequest(), op("k2", 1))
    before = fresh_info(host)

    again = host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("k1", 0))

    assert again == dataclasses.replace(first, replayed=True)  # the digest it recorded, too
    assert fresh_info(host) == before and before.position == 2
    assert [e.operation_key for e in host.journal.entries()] == ["k1", "k2"]


def test_a_reused_key_with_another_payload_is_already_exists(host):
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("k1"))
    before = fresh_info(host)

    with pytest.raises(AlreadyExists, match="'k1' was already used for another ForwardBackward"):
        host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("k1"))
    with pytest.raises(AlreadyExists):
        host.apply(ops.OPTIM_STEP, OptimStepRequest(), op("k1"))
    assert fresh_info(host) == before and before.position == 1


def test_a_position_mismatch_names_the_real_position_and_changes_nothing(host):
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("k1", 0))
    before = fresh_info(host)

    with pytest.raises(PositionMismatch, match="the session is at position 1") as raised:
        host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("k2", 0))

    assert raised.value.position == 1
    assert fresh_info(host) == before
    assert host.journal.lookup("k2") is None


def test_an_engine_error_is_not_journaled_and_moves_nothing(host):
    before = fresh_info(host)

    with pytest.raises(InvalidArgument, match="empty batch"):
        host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest([]), op("k1", 0))
    with pytest.raises(FailedPrecondition, match="run forward_backward first"):
        host.apply(ops.OPTIM_STEP, OptimStepRequest(), op("k1", 0))

    assert fresh_info(host) == before and before.position == 0
    assert host.journal.entries() == []


def test_the_digest_is_computed_only_when_asked(host):
    plain = host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("k1"))
    asked = host.apply(
        ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("k2", digest=True)
    )

    assert plain.state_digest == ""
    assert asked.state_digest == host.info().state_digest
    # A replay of the last operation may still ask: the state is the one it left.
    assert host.apply(
        ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("k2", digest=True)
    ).state_digest == (asked.state_digest)


def test_save_state_records_where_the_session_stands_in_the_checkpoint(host):
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("k1"))
    saved = host.apply(ops.SAVE_STATE, CheckpointRequest("c1"), op("k2"))

    server = read_extra(host.state_dir.run("run").checkpoint("c1"))["server"]

    assert (server["run_id"], server["position"], server["operation_key"]) == ("run", 2, "k2")
    assert server["result"]["state_digest"] == saved.state_digest == host.info().state_digest


def test_a_closed_run_keeps_its_files_and_a_new_run_starts_fresh_beside_it(host, host_config):
    run_ops(host, 0, 1)
    host.apply(ops.SAVE_STATE, CheckpointRequest("c1"), op("save"))
    closed = host.close()

    assert closed.state == outcomes.CLOSED and host.info() == closed
    assert host.close() == closed  # idempotent
    with pytest.raises(FailedPrecondition, match="was closed"):
        host.open("run", host_config, 10, "sha256:plan")
    opened = host.open("run2", host_config, 10)
    assert (opened.created, opened.position, opened.run_id) == (True, 0, "run2")
    assert host.state_dir.run("run").checkpoint("c1").is_dir()
    with pytest.raises(NotFound):  # the other run's checkpoint is not this run's
        host.apply(ops.LOAD_STATE, CheckpointRequest("c1"), op("load"))


def test_export_from_a_checkpoint_leaves_the_live_state_alone(host):
    run_ops(host, 0, 1)
    host.apply(ops.SAVE_STATE, CheckpointRequest("c1"), op("save"))
    run_ops(host, 3, 1)
    digest = fresh_info(host).state_digest

    exported = host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("best", "c1"), op("export"))

    assert fresh_info(host).state_digest == digest  # the export itself takes a position
    assert exported.format == outcomes.FORMAT_FULL and exported.directory.is_dir()
    assert {f.path for f in exported.files} >= {"config.json", "model.safetensors"}
    with pytest.raises(NotFound, match="no checkpoint named 'nope'"):
        host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("other", "nope"), op("export2"))


def test_shutdown_refuses_new_operations_and_lets_the_one_in_flight_commit(host):
    session = host.session
    started, release = threading.Event(), threading.Event()
    original = session.forward_backward

    def slow(examples, **loss):
        started.set()
        release.wait(10)
        return original(examples, **loss)

    session.forward_backward = slow
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("k1"))
        )
    )
    worker.start()
    assert started.wait(10)

    host.begin_shutdown()
    with pytest.raises(Unavailable, match="shutting down"):
        host.apply(ops.OPTIM_STEP, OptimStepRequest(), op("k2"))
    assert not host.wait_idle(0.05)
    release.set()
    worker.join(10)

    assert host.wait_idle(10)
    assert results[0].position == 1 and host.journal.lookup("k1") is not None


def test_the_same_key_sent_concurrently_runs_once(host):
    session = host.session
    calls = []
    original = session.forward_backward
    session.forward_backward = lambda examples, **loss: (
        calls.append(1) or original(examples, **loss)
    )
    barrier = threading.Barrier(6)
    outcomes = []

    def send() -> None:
        barrier.wait(10)
        outcomes.append(
            host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("same", 0))
        )

    threads = [threading.Thread(target=send) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert len(calls) == 1
    assert sorted(o.replayed for o in outcomes) == [False] + [True] * 5
    assert {o.loss for o in outcomes} == {outcomes[0].loss}


def test_classification_forward_reports_predictions_in_label_order(
    make_host, llama_classifier_config
):
    host = make_host()
    config = llama_classifier_config()
    host.open("cls", config, 4)
    local = TrainingSession(config, device="cpu", max_steps=4)

    remote = host.apply(ops.FORWARD, ForwardRequest(REVIEWS[:4]))
    expected = local.forward(REVIEWS[:4])

    assert remote.loss == expected.loss
    assert [(p.label, list(p.scores)) for p in remote.predictions] == [
        (p.label, list(p.scores)) for p in expected.predictions
    ]

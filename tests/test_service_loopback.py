"""Real servers on 127.0.0.1: remote equals in-process, exactly-once under retries, lost responses
and 16 concurrent callers, verified downloads, graceful stops, health and reflection."""

from __future__ import annotations

import threading

import grpc
import pytest
from fresh_state import fresh_server_info
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from ledger_files import opened_journal
from service_fixtures import (
    NO_RETRY,
    REVIEWS,
    TEXTS,
    DropFirstResponse,
    apply_local,
    apply_remote,
    connect,
    microbatches,
    running_server,
    training_ops,
    wait_for,
)

from trainwire.client.session.retry import position_from_error
from trainwire.client.session.session_client import DownloadError
from trainwire.contract import codec, outcomes
from trainwire.server.engine.session import TrainingSession
from trainwire.server.grpc.listener import SERVICE_NAME


@pytest.fixture
def server(tmp_path, model_root):
    with running_server(tmp_path / "state", model_root) as handle:
        yield handle


@pytest.fixture
def client(server):
    with connect(server) as client:
        yield client


@pytest.mark.parametrize("variant", ["full causal-lm", "lora classifier"])
def test_remote_training_equals_in_process_training(
    client, variant, llama_config, llama_classifier_config, small_lora
):
    if variant == "full causal-lm":
        config, examples = llama_config(), TEXTS[:12]
    else:
        config, examples = llama_classifier_config(lora=small_lora), REVIEWS[:12]
    ops = training_ops(examples)
    local = TrainingSession(config, device="cpu", max_steps=4)

    client.open("run", config, max_steps=4)
    remote = apply_remote(client, ops, "run")
    expected = apply_local(local, ops)
    remote_eval, local_eval = client.forward(examples[:4]), local.forward(examples[:4])

    assert [o.loss for o in remote if isinstance(o, outcomes.ForwardBackwardOutcome)] == [
        loss for loss in expected if isinstance(loss, float)
    ]
    assert [(o.step, o.learning_rate, o.grad_norm) for o in remote if hasattr(o, "grad_norm")] == [
        (r.step, r.learning_rate, r.grad_norm) for r in expected if not isinstance(r, float)
    ]
    assert remote_eval.loss == local_eval.loss
    assert [(p.label, list(p.scores)) for p in remote_eval.predictions] == [
        (p.label, list(p.scores)) for p in local_eval.predictions
    ]
    assert client.info().state_digest == local.state_digest()


def test_a_retried_key_gets_its_recorded_result_and_a_reused_key_is_already_exists(
    server, client, llama_config
):
    client.open("run", llama_config(), max_steps=4)
    batch, other = microbatches(TEXTS)[:2]
    first = client.forward_backward(batch, operation_key="k1", expected_position=0)
    before = fresh_server_info(server)

    again = client.forward_backward(batch, operation_key="k1", expected_position=0)
    with pytest.raises(grpc.RpcError) as reused:
        client.forward_backward(other, operation_key="k1", expected_position=1)

    assert (again.replayed, again.loss, again.position) == (True, first.loss, 1)
    assert reused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already used" in reused.value.details()
    assert fresh_server_info(server) == before and before.position == 1


def test_a_position_mismatch_reports_the_real_position_in_trailing_metadata(client, llama_config):
    client.open("run", llama_config(), max_steps=4)
    client.forward_backward(TEXTS[:3], operation_key="k1", expected_position=0)

    with pytest.raises(grpc.RpcError) as stale:
        client.optim_step(operation_key="k2", expected_position=0)

    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (codec.POSITION_METADATA_KEY, "1") in stale.value.trailing_metadata()
    assert position_from_error(stale.value) == 1


def test_lost_responses_are_retried_by_the_client_and_applied_exactly_once(
    tmp_path, model_root, llama_config
):
    config = llama_config()
    ops = training_ops(TEXTS[:12])
    dropper = DropFirstResponse()
    with (
        running_server(tmp_path / "state", model_root, interceptors=[dropper]) as handle,
        connect(handle) as client,
    ):
        client.open("run", config, max_steps=4)
        outcomes = apply_remote(client, ops, "run")
        saved = client.save_state("c1", operation_key="save", expected_position=len(ops))
        exported = client.export_weights(
            "final", operation_key="export", download_to=tmp_path / "download"
        )
        entries = handle.session_host.journal.entries(include_rolled_back=True)
    local = TrainingSession(config, device="cpu", max_steps=4)
    apply_local(local, ops)

    keys = [f"run/{i}" for i in range(len(ops))] + ["save", "export"]
    assert dropper.dropped == set(keys)  # every first response was lost
    assert all(o.replayed for o in [*outcomes, saved, exported])
    assert [(e.operation_key, e.position) for e in entries] == [
        (key, position) for position, key in enumerate(keys, start=1)
    ]
    assert saved.state_digest == local.state_digest()
    assert (tmp_path / "download" / "model.safetensors").is_file()


def test_sixteen_threads_of_keyed_operations_apply_each_exactly_once_in_some_serial_order(
    client, server, llama_config
):
    config = llama_config()
    client.open("run", config, max_steps=4)
    batches = microbatches(TEXTS * 2)  # 16 microbatches of 3
    keyed = {f"t{t}/{j}": batches[(t + j) % 16] for t in range(16) for j in range(3)}
    outcomes: dict[str, list[outcomes.ForwardBackwardOutcome]] = {key: [] for key in keyed}
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def worker(t: int) -> None:
        # Each thread sends its own keys and, in between, its neighbour's first key again.
        mine = [f"t{t}/{j}" for j in range(3)]
        sends = [mine[0], f"t{(t + 1) % 16}/0", mine[1], mine[2]]
        try:
            start.wait(30)
            for key in sends:
                outcomes[key].append(client.forward_backward(keyed[key], operation_key=key))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    assert not errors and not any(thread.is_alive() for thread in threads)
    assert all(sorted(o.replayed for o in got)[0] is False for got in outcomes.values())
    assert sum(not o.replayed for got in outcomes.values() for o in got) == 48
    entries = server.session_host.journal.entries()
    assert sorted(e.position for e in entries) == list(range(1, 49))
    # Replaying the journal's order in-process gives the same losses and the same bits: nothing
    # interleaved inside the session.
    local = TrainingSession(config, device="cpu", max_steps=4)
    for entry in sorted(entries, key=lambda e: e.position):
        assert local.forward_backward(keyed[entry.operation_key]) == entry.result["loss"]
    assert client.info().state_digest == local.state_digest()


def test_export_downloads_verified_files_atomically_and_refuses_changed_ones(
    client, server, tmp_path, llama_config
):
    client.open("run", llama_config(), max_steps=4)
    apply_remote(client, training_ops(TEXTS[:6]), "run")
    target = tmp_path / "download"

    exported = client.export_weights("final", operation_key="export", download_to=target)

    on_server = server.session_host.state_dir.run("run").export("final")
    assert exported.directory == target
    for file in exported.files:
        assert (target / file.path).read_bytes() == (on_server / file.path).read_bytes()
    (on_server / "config.json").write_text("{}")  # the export changed under the record
    with pytest.raises(DownloadError, match=r"config\.json: received 2 bytes"):
        client.export_weights("final", operation_key="export", download_to=target, replace=True)
    assert (target / "config.json").stat().st_size == exported.files[0].size_bytes  # untouched
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_unopened_session_refuses_operations_and_reports_idle(client):
    with pytest.raises(grpc.RpcError) as refused:
        client.forward_backward(TEXTS[:3], operation_key="k")

    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "call Open first" in refused.value.details()
    assert client.info().state == outcomes.IDLE


def test_health_is_serving_and_reflection_lists_the_service(client, server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING

    services = ProtoReflectionDescriptorDatabase(channel).get_services()

    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
    channel.close()


def test_a_graceful_stop_lets_the_operation_in_flight_commit_and_refuses_new_ones(
    tmp_path, model_root, llama_config
):
    state_dir = tmp_path / "state"
    handle_box = {}
    with running_server(state_dir, model_root) as handle:
        handle_box["handle"] = handle
        client = connect(handle, retry=NO_RETRY)
        client.open("run", llama_config(), max_steps=4)
        session = handle.session_host.session
        started, release = threading.Event(), threading.Event()
        original = session.forward_backward

        def slow(examples, **loss):
            started.set()
            release.wait(30)
            return original(examples, **loss)

        session.forward_backward = slow
        results: list[object] = []
        caller = threading.Thread(
            target=lambda: results.append(client.forward_backward(TEXTS[:3], operation_key="k1"))
        )
        caller.start()
        assert started.wait(30)
        stopper = threading.Thread(target=handle.stop, kwargs={"grace": 30})
        stopper.start()
        wait_for(lambda: handle.session_host.lifecycle.shutting_down)

        with pytest.raises(grpc.RpcError) as refused:
            client.optim_step(operation_key="k2")
        release.set()
        caller.join(30)
        stopper.join(30)

    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert results and results[0].position == 1
    assert handle_box["handle"].wait(1)
    with opened_journal(state_dir, "run") as journal:
        assert [e.operation_key for e in journal.entries()] == ["k1"]


def test_a_stopped_server_leaves_no_handler_thread_behind(tmp_path, model_root, llama_config):
    """An embedding process that starts and stops servers keeps no thread of theirs (each
    stopped server used to leave its gRPC handler pool's threads)."""
    before = set(threading.enumerate())
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("run", llama_config(), max_steps=4)
        client.forward_backward(TEXTS[:3], operation_key="k1")
        started = set(threading.enumerate()) - before
        handlers = [t for t in started if t.name.startswith("trainwire-rpc")]
        assert handlers
        client.close_channel()
    wait_for(lambda: not any(t.is_alive() for t in handlers))

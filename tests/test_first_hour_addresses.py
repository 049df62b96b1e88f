"""A wrong address fails within seconds, in one line; a refusal is one line, never a traceback.

Before, ``trainwire run`` at a port nobody listens on, an ``http://`` URL, a host without a port
or an HTTP port said "waiting up to 1h00m" and waited an hour; a ``SessionClient`` refusal was
grpc's 26-line ``_InactiveRpcError``. Each test here is bounded well below the old waits, so the
old behaviour fails it.
"""

from __future__ import annotations

import http.server
import logging
import threading
import traceback
from pathlib import Path

import grpc
import pytest
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.cli import main
from trainwire.client import (
    ManagedTrainingPlan,
    ServerUnreachable,
    SessionClient,
    SessionError,
    TrainingConfig,
)
from trainwire.client.control.controller import Controller
from trainwire.client.control.cursor import Record, WorkDirectory
from trainwire.contract.planning.manifest import write_plan_manifest
from trainwire.contract.run.replay import RunState
from trainwire.server import serve
from trainwire.testing import free_port, tiny_text_examples


@pytest.fixture
def manifest(tmp_path: Path, tiny_llama: Path) -> Path:
    config = TrainingConfig(model=str(tiny_llama), batch_size=4, lr_scheduler="constant")
    path = tmp_path / "manifest.json"
    write_plan_manifest(path, ManagedTrainingPlan(tiny_text_examples(8), config))
    return path


def run_against(target: str, manifest: Path, tmp_path: Path, capsys) -> tuple[int, list[str]]:
    args = ["run", "--server", target, "--manifest", str(manifest), "--run-id", "r"]
    code = main([*args, "--work-dir", str(tmp_path / "work"), "--quiet"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith("trainwire run:")]


@pytest.mark.timeout(90)
def test_run_against_a_port_nobody_listens_on_fails_in_one_line(manifest, tmp_path, capsys):
    port = free_port()
    code, lines = run_against(f"127.0.0.1:{port}", manifest, tmp_path, capsys)
    assert code == 1
    assert len(lines) == 1
    assert f"no trainwire server at 127.0.0.1:{port}" in lines[0]
    assert f"nothing listens on port {port}" in lines[0] and "(UNAVAILABLE)" in lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("http://127.0.0.1:50051", "is a URL: a trainwire server's gRPC address is HOST:PORT"),
        ("127.0.0.1", "has no port: give HOST:PORT"),
    ],
)
def test_a_url_or_a_host_without_a_port_is_refused_before_any_connection(
    target, says, manifest, tmp_path, capsys
):
    code, lines = run_against(target, manifest, tmp_path, capsys)
    assert code == 2
    assert len(lines) == 1 and says in lines[0]


@pytest.mark.timeout(60)
def test_an_endpoint_that_does_not_speak_grpc_fails_at_once_saying_so():
    http_server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler
    )
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    try:
        with (
            SessionClient(f"127.0.0.1:{http_server.server_port}") as client,
            pytest.raises(ServerUnreachable) as refused,
        ):
            client.info()
    finally:
        http_server.shutdown()
        http_server.server_close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "does not answer gRPC" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_refusal_is_trainwires_own_one_line_error_without_a_grpc_traceback(model_root, tmp_path):
    with (
        running_server(tmp_path / "state", model_root) as handle,
        connect(handle, retry=NO_RETRY) as client,
        pytest.raises(SessionError) as refused,
    ):
        client.open("first-hour", TrainingConfig(model="no-such-model"))
    error = refused.value
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.NOT_FOUND
    assert str(error) == f"{error.details()} (NOT_FOUND)" and "\n" not in str(error)
    assert "no-such-model" in error.details()
    printed = "".join(traceback.format_exception(error))
    assert "_InactiveRpcError" not in printed and "grpc._channel" not in printed


def test_a_wrong_token_file_is_named_rather_than_asked_for(model_root, tmp_path, capsys):
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    with running_server(tmp_path / "state", model_root, token="the-token") as handle:
        code = main(["close", "--server", handle.target, "--token-file", str(wrong)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.count("\n") == 0
    assert f"the token in --token-file {wrong} is not the one the server was started" in err
    assert "give --token-file" not in err


@pytest.mark.slow  # a server started, stopped and started again: 10-15 s on two busy cores
@pytest.mark.timeout(120)
def test_the_controller_waits_for_a_server_its_run_reached_before(manifest, model_root, tmp_path):
    """A restarted controller whose server is restarting too: its work directory records the
    run, so the server is waited for, as before, and the run ends."""
    from trainwire.contract.planning.manifest import load_plan

    plan = load_plan(manifest)
    work = WorkDirectory(tmp_path / "work", run_id="r", manifest_fingerprint=plan.fingerprint)
    work.bind()
    work.write_cursor(Record(0, RunState.start(plan)))
    port = free_port()
    waiting = threading.Event()

    class Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "server unreachable" in record.getMessage():
                waiting.set()

    handler = Waiting()
    logging.getLogger("trainwire.client.control.controller").addHandler(handler)
    result: list = []
    client = SessionClient(f"127.0.0.1:{port}")
    controller = Controller(client, plan, run_id="r", work_dir=tmp_path / "work")
    thread = threading.Thread(target=lambda: result.append(controller.run()), daemon=True)
    thread.start()
    try:
        assert waiting.wait(60), "the controller never said it waits"
        handle = serve(listen=f"127.0.0.1:{port}", state_dir=tmp_path / "state", device="cpu")
        try:
            thread.join(90)
        finally:
            handle.stop(grace=10)
    finally:
        logging.getLogger("trainwire.client.control.controller").removeHandler(handler)
        client.close_channel()
    assert result and result[0].state_digest.startswith("sha256:")

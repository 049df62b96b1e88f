"""What the server and the controller log at INFO and above: what a person acts on, one line
each. Per-operation detail and each retry's wait are debug level."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import grpc
import pytest
from plans import sentiment_plan
from service_fixtures import connect, running_server

from trainwire.client import InputExample
from trainwire.client.control.controller import Controller
from trainwire.client.session.retry import RetryPolicy, call_with_retry
from trainwire.contract.run.progress import Progress
from trainwire.server import serve
from trainwire.server.library_warnings import QUIET_WARNINGS, quiet_library_warnings
from trainwire.testing import free_port


def test_the_server_logs_no_info_line_per_operation(
    tmp_path: Path, model_root: Path, llama_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trainwire.server")
    with running_server(tmp_path / "state", model_root) as handle, connect(handle) as client:
        client.open("run", llama_config(), max_steps=3)
        for i in range(3):
            client.forward_backward([InputExample("hello world")], operation_key=f"run/{i}/fb")
            client.optim_step(operation_key=f"run/{i}/step")
        client.close()
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(loud) <= 5, loud  # listening, run opened, run closed, stopped
    assert not [m for m in loud if m.startswith("operation ")]
    detail = [r for r in caplog.records if r.getMessage().startswith("operation ")]
    assert len(detail) >= 7 and all(r.levelno == logging.DEBUG for r in detail)


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1"


def test_a_retried_call_logs_its_waits_at_debug_level(caplog: pytest.LogCaptureFixture) -> None:
    tries = []

    def flaky() -> str:
        tries.append(1)
        if len(tries) < 4:
            raise Unavailable()
        return "ok"

    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.0)
    with caplog.at_level(logging.DEBUG, logger="trainwire.client.session.retry"):
        assert call_with_retry(flaky, policy, sleep=lambda s: None) == "ok"
    assert len(caplog.records) == 3
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_an_outage_is_one_warning_and_its_end_one_line(
    bert_classifier_config: Any, model_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = sentiment_plan(bert_classifier_config, num_epochs=1)
    listen = f"127.0.0.1:{free_port()}"
    options = {"state_dir": tmp_path / "state", "model_root": model_root, "device": "cpu"}
    servers = [serve(listen=listen, **options)]
    restarted = threading.Event()
    progress: list[Progress] = []

    def restart_later() -> None:
        time.sleep(1.0)  # long enough for several tries to fail
        servers.append(serve(listen=listen, **options))
        restarted.set()

    def down_once(step: Progress) -> None:
        progress.append(step)
        if step.microbatch == 1 and len(servers) == 1 and not restarted.is_set():
            servers[0].stop(grace=10)
            threading.Thread(target=restart_later, daemon=True).start()

    client = connect(servers[0])
    try:
        with caplog.at_level(logging.DEBUG, logger="trainwire.client"):
            Controller(client, plan, run_id="r", work_dir=tmp_path / "work", window=1).run(
                on_step=down_once
            )
    finally:
        client.close_channel()
        restarted.wait(30)
        servers[-1].stop(grace=10)
    client_records = [r for r in caplog.records if r.name.startswith("trainwire.client")]
    loud = [r.getMessage() for r in client_records if r.levelno >= logging.INFO]
    assert len(loud) == 2, loud
    assert "server unreachable (UNAVAILABLE)" in loud[0]
    assert "server back after" in loud[1] and "resuming at microbatch" in loud[1]
    resumed = [p.extra["resumed"] for p in progress if "resumed" in p.extra]
    assert len(resumed) == 2  # the start, and the resume the progress view counts its rate from


def test_library_warnings_nobody_acts_on_are_filtered_exactly() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_warnings()
        for category, message, module in QUIET_WARNINGS:
            text = message.replace("\\", "") + " and will be removed"
            module_name = module.replace("\\", "")
            warnings.warn_explicit(text, category, "library.py", 1, module=module_name)
            warnings.warn_explicit("another warning", category, "library.py", 1, module=module_name)
    assert [str(w.message) for w in caught] == ["another warning"] * len(QUIET_WARNINGS)

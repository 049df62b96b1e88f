"""A run that finished is closed and durable (issue 24.5): the controller closes its run once the
export is downloaded and the summary written, a restart of the server rolls nothing of it back
(its final export stays), the next run opens, and resuming the finished run changes nothing."""

from __future__ import annotations

import hashlib

import grpc
import pytest
from plans import sentiment_plan
from service_fixtures import connect, running_server

from trainwire.client.control.controller import EXPORT_NAME, Controller
from trainwire.server.errors import FailedPrecondition


def export_hashes(state_dir, run_id: str) -> dict[str, str]:
    export = state_dir / "runs" / run_id / "exports" / EXPORT_NAME
    return {
        str(path.relative_to(export)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(export.rglob("*"))
        if path.is_file()
    }


def test_a_finished_run_is_closed_survives_a_restart_and_the_next_run_opens(
    bert_classifier_config, model_root, tmp_path
) -> None:
    plan = sentiment_plan(bert_classifier_config)
    state = tmp_path / "state"
    with running_server(state, model_root) as handle, connect(handle) as client:
        first = Controller(client, plan, run_id="first", work_dir=tmp_path / "first").run()
        info = client.info()
        assert (info.run_id, info.state) == ("first", "closed")
    exported = export_hashes(state, "first")
    assert exported

    with running_server(state, model_root) as handle, connect(handle) as client:
        assert client.info().state == "idle"  # nothing to restore: the run was closed
        assert export_hashes(state, "first") == exported  # nothing of it rolled back
        again = Controller(client, plan, run_id="first", work_dir=tmp_path / "first").run()
        assert again == first  # a finished run resumed: its recorded result, nothing replayed
        second = Controller(client, plan, run_id="second", work_dir=tmp_path / "second").run()
        assert second.state_digest == first.state_digest
        assert client.info().state == "closed"
        assert export_hashes(state, "first") == exported


def test_closing_a_run_by_id_never_closes_another(make_host, host_config) -> None:
    host = make_host()
    host.open("mine", host_config, 10)
    host.close("mine")
    assert host.close("mine").state == "closed"  # again: a no-op
    host.open("theirs", host_config, 10)
    with pytest.raises(FailedPrecondition, match="'mine' is not the open run"):
        host.close("mine")
    assert host.info().state == "open"


def test_close_by_run_id_over_grpc(model_root, tmp_path, llama_config) -> None:
    with running_server(tmp_path / "state", model_root) as handle, connect(handle) as client:
        client.open("a", llama_config(), max_steps=2)
        with pytest.raises(grpc.RpcError) as refused:
            client.close(run_id="b")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # "a" is open
        assert client.close(run_id="a").state == "closed"
        assert client.close(run_id="a").state == "closed"


def test_the_command_line_closes_a_run_and_says_a_refusal_in_one_line(
    model_root, tmp_path, llama_config, capsys
) -> None:
    from trainwire.cli import main

    token = tmp_path / "token"
    token.write_text("the-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    with running_server(tmp_path / "state", model_root, token="the-token") as handle:
        with connect(handle, token="the-token") as client:
            client.open("left-open", llama_config(), max_steps=2)
        target = handle.target
        assert main(["close", "--server", target, "--token-file", str(wrong)]) == 1
        refused = capsys.readouterr().err
        assert refused.count("\n") == 1 and "Traceback" not in refused
        assert "UNAUTHENTICATED" in refused and "--token-file" in refused
        assert main(["close", "--server", target, "--token-file", str(token)]) == 0
        assert "left-open: closed at position 0" in capsys.readouterr().out
        with connect(handle, token="the-token") as client:
            assert client.info().state == "closed"

"""A client is bound to the run it opened: every call names that run, so a call from a client whose
run was closed never lands on the run opened after it (NOT_FOUND, nothing applied), its ``info()``
says its run is closed, and ``runs()`` lists what is open. A client that opened nothing still
reaches the server's only run."""

from __future__ import annotations

import grpc
import pytest
from service_fixtures import TEXTS, connect, microbatches, running_server

from trainwire.client import SessionError

BATCH = microbatches(TEXTS)[0]


def test_a_client_whose_run_closed_never_reaches_the_next_run(tmp_path, model_root, llama_config):
    config = llama_config()
    with (
        running_server(tmp_path / "state", model_root) as server,
        connect(server) as first,
        connect(server) as second,
        connect(server) as unbound,
    ):
        first.open("a", config)
        first.forward_backward(BATCH, operation_key="a/0")
        assert [info.run_id for info in first.runs()] == ["a"]
        second.close("a")
        second.open("b", config)

        with pytest.raises(SessionError) as refused:
            first.forward_backward(BATCH, operation_key="a/1")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert "run 'a' is not open on this server" in str(refused.value)
        with pytest.raises(SessionError) as sampled:
            first.sample([1, 2, 3], max_tokens=2)
        assert sampled.value.code() == grpc.StatusCode.NOT_FOUND
        assert second.info().position == 0  # nothing of "a"'s landed on "b"

        closed = first.info()
        assert (closed.run_id, closed.state) == ("a", "closed")
        assert [info.run_id for info in first.runs()] == ["b"]
        unbound.forward_backward(BATCH, operation_key="u/0")  # the server's only run
        assert second.info().position == 1 and second.info().last_operation_key == "u/0"
        with pytest.raises(SessionError) as unknown:
            unbound.close("never-opened")
        assert unknown.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(SessionError) as other:
            first.close()  # its own run: closed already, and never "b" in its place
        assert other.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert second.info().state == "open"

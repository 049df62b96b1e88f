"""Every request is bounded before work starts: counts, characters, tokens, model positions."""

from __future__ import annotations

import grpc
import pytest
from fresh_state import fresh_digest, fresh_server_info
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import InputExample, TokenExample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument
from trainwire.server.service import request_limits


@pytest.fixture
def served(tmp_path, model_root, llama_config):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("bounds", llama_config())
        client.forward_backward([InputExample("a first microbatch")], operation_key="first")
        yield handle, client
        client.close_channel()


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([InputExample("hi")] * (request_limits.MAX_EXAMPLES + 1), "examples in one request"),
        (
            [InputExample("x" * (request_limits.MAX_TEXT_CHARS // 4))] * 5,
            "characters of text in one request",
        ),
    ],
)
def test_oversized_requests_are_refused_before_any_work(served, batch, message):
    handle, client = served
    before = fresh_server_info(handle)
    for call in (
        lambda: client.forward_backward(batch, operation_key="big"),
        lambda: client.forward(batch),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert message in refused.value.details()
    assert fresh_server_info(handle) == before


def test_too_many_tokens_in_one_request_are_refused(monkeypatch):
    monkeypatch.setattr(request_limits, "MAX_TOKENS", 100)
    with pytest.raises(request_limits.ResourceExhausted, match="101 tokens in one request"):
        request_limits.check_batch(
            [TokenExample([1] * 50, [2] * 50), TokenExample([1] * 51, [2] * 51)]
        )


def test_a_text_that_cannot_fit_max_length_is_refused_untokenized(llama_config, monkeypatch):
    session = TrainingSession(llama_config(max_length=16), device="cpu")

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized a text that could never fit")

    monkeypatch.setattr(session.encoder, "token_ids", refuse)
    before = fresh_digest(session)
    with pytest.raises(InvalidArgument, match="characters cannot fit max_length 16 tokens"):
        session.forward_backward([InputExample("x" * (16 * 64 + 1))])
    assert fresh_digest(session) == before

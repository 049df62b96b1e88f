"""The bad-input table: each mistake gets its status code and a message that says what to fix,
the session's state digest does not move, and the server keeps serving."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from fresh_state import fresh_server_info
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import InputExample, SessionClient
from trainwire.server.engine.session import TrainingSession

TOKEN = "s3cret-token"
MAX_MESSAGE_BYTES = 256 * 1024
GOOD = InputExample("The movie was good.", label="positive")
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def table(tmp_path_factory, model_root, llama_classifier_config):
    """A token-guarded server with a small message cap and a fresh classifier session open."""
    state_dir = tmp_path_factory.mktemp("table")
    config = llama_classifier_config()
    with running_server(
        state_dir, model_root, token=TOKEN, max_message_bytes=MAX_MESSAGE_BYTES
    ) as handle:
        client = connect(handle, token=TOKEN, retry=NO_RETRY)
        client.open("table", config, max_steps=4)
        # A checkpoint of another config, planted among this run's checkpoints.
        other = TrainingSession(config.replace(learning_rate=0.5), device="cpu", max_steps=4)
        other.save_state(state_dir / "runs" / "table" / "checkpoints" / "foreign")
        yield handle, client, config
        client.close_channel()


def key(name: str) -> dict[str, Any]:
    return {"operation_key": f"bad/{name}"}


def other_client(handle, token: str | None) -> SessionClient:
    return SessionClient(f"127.0.0.1:{handle.port}", token=token, retry=NO_RETRY, timeout_s=30)


BAD_INPUTS: list[tuple[str, Callable[..., Any], grpc.StatusCode, str]] = [
    (
        "open with another config",
        lambda c, cfg, h: c.open("table", cfg.replace(learning_rate=0.5), max_steps=4),
        Code.FAILED_PRECONDITION,
        r"another config \(learning_rate: open 0.001, requested 0.5\).*new run id",
    ),
    (
        "fp16 config",
        lambda c, cfg, h: c.open("table", dict(cfg.to_dict(), precision="fp16"), max_steps=4),
        Code.INVALID_ARGUMENT,
        "fp16 is not supported.*use fp32",
    ),
    (
        "empty batch",
        lambda c, cfg, h: c.forward_backward([], **key("empty")),
        Code.INVALID_ARGUMENT,
        "empty batch: send at least one example",
    ),
    (
        "empty text",
        lambda c, cfg, h: c.forward_backward(
            [GOOD, InputExample("", label="negative")], **key("t")
        ),
        Code.INVALID_ARGUMENT,
        "example 1: empty text",
    ),
    (
        "unknown label",
        lambda c, cfg, h: c.forward_backward([InputExample("x", label="meh")], **key("label")),
        Code.INVALID_ARGUMENT,
        r"unknown label 'meh'; the config's labels are \['negative', 'positive'\]",
    ),
    (
        "over-long example",
        lambda c, cfg, h: c.forward([InputExample("good " * 200, label="positive")]),
        Code.INVALID_ARGUMENT,
        "tokens is over max_length 64; shorten it, raise max_length, or set truncation",
    ),
    (
        "no operation key",
        lambda c, cfg, h: c.optim_step(operation_key=""),
        Code.INVALID_ARGUMENT,
        "operation_key is required",
    ),
    *[
        (
            f"odd name {label}",
            call,
            Code.INVALID_ARGUMENT,
            "is not allowed: use 1-128 characters from A-Z a-z 0-9 . _ -",
        )
        for label, call in [
            ("save ../escape", lambda c, cfg, h: c.save_state("../escape", **key("s"))),
            ("load a/b", lambda c, cfg, h: c.load_state("a/b", **key("l"))),
            ("export ..", lambda c, cfg, h: c.export_weights("..", **key("e"))),
            ("export .hidden", lambda c, cfg, h: c.export_weights(".hidden", **key("e"))),
            (
                "checkpoint ../x",
                lambda c, cfg, h: c.export_weights("e", checkpoint="../x", **key("e")),
            ),
            ("weights ../../x", lambda c, cfg, h: c.load_weights("checkpoint:../../x", **key("w"))),
            ("129 chars", lambda c, cfg, h: c.save_state("x" * 129, **key("long"))),
        ]
    ],
    (
        "model path outside the model root",
        lambda c, cfg, h: c.load_weights("model:../../etc", **key("model")),
        Code.INVALID_ARGUMENT,
        "resolves outside the model root",
    ),
    (
        "missing checkpoint",
        lambda c, cfg, h: c.load_state("nope", **key("missing")),
        Code.NOT_FOUND,
        "no checkpoint at .*nope",
    ),
    (
        "checkpoint of another config",
        lambda c, cfg, h: c.load_state("foreign", **key("foreign")),
        Code.FAILED_PRECONDITION,
        "belongs to another session: config fingerprint.*learning_rate: saved 0.5, now 0.001",
    ),
    (
        "oversized message",
        lambda c, cfg, h: c.forward([InputExample("x" * MAX_MESSAGE_BYTES, label="positive")]),
        Code.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
    (
        "missing token",
        lambda c, cfg, h: other_client(h, None).info(),
        Code.UNAUTHENTICATED,
        "missing bearer token: send metadata 'authorization: Bearer <token>'",
    ),
    (
        "wrong token",
        lambda c, cfg, h: other_client(h, "guess").info(),
        Code.UNAUTHENTICATED,
        "wrong bearer token",
    ),
]


@pytest.mark.parametrize(("call", "code", "match"), [row[1:] for row in BAD_INPUTS],
                         ids=[row[0] for row in BAD_INPUTS])  # fmt: skip
def test_bad_input_is_refused_with_its_code_and_changes_nothing(table, call, code, match):
    handle, client, config = table
    before = fresh_server_info(handle)

    with pytest.raises(grpc.RpcError) as refused:
        call(client, config, handle)

    assert refused.value.code() == code, refused.value.details()
    assert re.search(match, refused.value.details()), refused.value.details()
    after = fresh_server_info(handle)
    assert client.info().state == "open"  # still serving
    assert (after.state_digest, after.position, after.state) == (before.state_digest, 0, "open")

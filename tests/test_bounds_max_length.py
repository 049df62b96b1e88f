"""A max_length the model cannot hold is refused when the session is built, with the limit in
the message, before any weights load; never trained silently at the model's positions instead.

The Tinker front asks for 32,768 tokens, or the model's positions where it has fewer, so a small
model is still one the SDK can train.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import TokenExample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session import session as session_module
from trainwire.server.errors import InvalidArgument
from trainwire.server.tinker.model import MAX_LENGTH, fit_max_length, training_config

POSITIONS = 256  # the tiny llama's max_position_embeddings


def no_load(*args, **kwargs):
    raise AssertionError("weights loaded for a config that should have been refused")


@pytest.mark.parametrize("max_length", [POSITIONS + 1, 10**7])
def test_a_max_length_past_the_models_positions_is_refused_before_any_weights_load(
    llama_config, monkeypatch, max_length
):
    monkeypatch.setattr(session_module, "load_session_model", no_load)
    with pytest.raises(InvalidArgument) as refused:
        TrainingSession(llama_config(max_length=max_length), device="cpu")
    message = str(refused.value)
    assert f"max_length {max_length} is more than the {POSITIONS} positions" in message
    assert f"set max_length to at most {POSITIONS}" in message


def test_a_max_length_of_exactly_the_models_positions_trains_at_it(llama_config):
    session = TrainingSession(llama_config(max_length=POSITIONS), device="cpu")
    assert session.encoder.max_length == POSITIONS
    session.forward_backward([TokenExample([5] * POSITIONS, [6] * POSITIONS)])
    too_long = TokenExample([5] * (POSITIONS + 1), [6] * (POSITIONS + 1))
    with pytest.raises(InvalidArgument) as refused:
        session.forward([too_long])
    # max_length cannot rise past the model's positions: the message does not suggest it
    assert str(refused.value) == (
        f"example 0: {POSITIONS + 1} tokens is over max_length 256; shorten it (the model has "
        f"{POSITIONS} positions)"
    )
    shorter = TrainingSession(llama_config(max_length=64), device="cpu")
    with pytest.raises(InvalidArgument, match=r"raise max_length \(up to the model's 256 "):
        shorter.forward([TokenExample([5] * 65, [6] * 65)])


def test_grpc_open_refuses_it_as_invalid_argument_and_opens_nothing(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        with pytest.raises(grpc.RpcError) as refused:
            client.open("too-long", llama_config(max_length=10**7))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "set max_length to at most 256" in refused.value.details()
        assert client.open("fits", llama_config(max_length=POSITIONS)).created
        client.close_channel()


def model_with_positions(source: Path, directory: Path, positions: int | None) -> Path:
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("max_position_embeddings")
    if positions is not None:
        config["max_position_embeddings"] = positions
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_tinker_front_asks_for_at_most_the_models_positions(tiny_llama, tmp_path):
    config = training_config({"base_model": "llama"})
    assert config.max_length == MAX_LENGTH == 32768
    assert fit_max_length(config, tiny_llama).max_length == POSITIONS
    large = model_with_positions(tiny_llama, tmp_path / "large", 131072)
    assert fit_max_length(config, large).max_length == MAX_LENGTH
    unknown = model_with_positions(tiny_llama, tmp_path / "unknown", None)
    assert fit_max_length(config, unknown).max_length == MAX_LENGTH
    assert fit_max_length(config, tmp_path / "missing").max_length == MAX_LENGTH

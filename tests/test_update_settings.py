"""Per-update AdamW settings (optim_step's beta1, beta2, eps, weight_decay, max_grad_norm): an
update given them is bit for bit the update of a run configured with them, the run's own settings
are back for the next one, bad values are refused naming the field and change nothing, and over
gRPC they are part of the operation's payload (journaled, replayed exactly once, another value
under the same key refused)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from fresh_state import fresh_digest
from host_operations import BATCHES, op
from service_fixtures import running_server

from trainwire.contract import codec
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import AlreadyExists, InvalidArgument
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import ForwardBackwardRequest, OptimStepRequest
from trainwire.testing import tiny_text_examples
from trainwire.v1 import session_pb2 as pb
from trainwire.v1 import session_pb2_grpc as pb_grpc

TEXTS = tiny_text_examples(6)
OVERRIDES = {"beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1, "max_grad_norm": 0.05}
AS_CONFIG = {
    "adam_beta1": 0.8,
    "adam_beta2": 0.99,
    "adam_epsilon": 1e-6,
    "weight_decay": 0.1,
    "max_grad_norm": 0.05,
}


def stepped(config, **settings) -> TrainingSession:
    session = TrainingSession(config, device="cpu", max_steps=4)
    session.forward_backward(TEXTS[:3])
    session.optim_step(**settings)
    return session


def adam_settings(session: TrainingSession) -> list[tuple[object, ...]]:
    return [(g["betas"], g["eps"], g["weight_decay"]) for g in session.optimizer.param_groups]


def test_an_update_given_settings_equals_a_run_configured_with_them(llama_config) -> None:
    given = stepped(llama_config(), **OVERRIDES)
    configured = stepped(llama_config(**AS_CONFIG))
    assert given.state_digest() == configured.state_digest()


def test_the_runs_own_settings_are_back_for_the_next_update(llama_config) -> None:
    session = stepped(llama_config(), **OVERRIDES)
    plain = stepped(llama_config())
    assert adam_settings(session) == adam_settings(plain)
    for session_ in (session, plain):
        session_.forward_backward(TEXTS[3:])
        session_.optim_step()
    assert session.state_digest() != plain.state_digest()  # the first update differed
    twice = stepped(llama_config(), **OVERRIDES)
    twice.forward_backward(TEXTS[3:])
    twice.optim_step()
    assert twice.state_digest() == session.state_digest()


def test_max_grad_norm_zero_is_no_clipping_for_that_update(llama_config) -> None:
    clipped_run = llama_config(max_grad_norm=0.05)
    assert stepped(clipped_run, max_grad_norm=0).state_digest() == (
        stepped(llama_config(max_grad_norm=None)).state_digest()
    )


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"beta1": 1.0}, "beta1 must be in \\[0, 1\\)"),
        ({"beta2": -0.1}, "beta2 must be in \\[0, 1\\)"),
        ({"eps": 0.0}, "eps must be a finite number > 0"),
        ({"weight_decay": float("nan")}, "weight_decay must be a finite number >= 0"),
        ({"max_grad_norm": -1.0}, "max_grad_norm must be a finite number >= 0"),
        ({"learning_rate": float("inf"), "beta1": True}, "learning_rate.*; beta1"),
    ],
)
def test_bad_settings_are_refused_naming_the_field_and_change_nothing(
    llama_config, settings, named
) -> None:
    session = TrainingSession(llama_config(), device="cpu", max_steps=4)
    session.forward_backward(TEXTS[:3])
    before = fresh_digest(session)
    with pytest.raises(InvalidArgument, match=named):
        session.optim_step(**settings)
    assert fresh_digest(session) == before and session.accumulated == 1


def test_the_settings_are_the_keys_payload_on_the_host(host) -> None:
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb", 0))
    step = OptimStepRequest(learning_rate=1e-3, eps=1e-6, beta2=0.99)
    first = host.apply(ops.OPTIM_STEP, step, op("step", 1))
    again = host.apply(ops.OPTIM_STEP, step, op("step", 1))
    assert again.replayed and (again.step, again.grad_norm) == (first.step, first.grad_norm)
    with pytest.raises(AlreadyExists, match="another OptimStep payload"):
        host.apply(ops.OPTIM_STEP, OptimStepRequest(learning_rate=1e-3, eps=1e-5), op("step"))
    with pytest.raises(InvalidArgument, match="beta1 must be in"):
        host.apply(ops.OPTIM_STEP, OptimStepRequest(beta1=2.0), op("bad"))
    assert host.info().position == 2


def test_grpc_optim_step_applies_the_settings_as_in_process(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    config = llama_config()
    expected = stepped(config, learning_rate=1e-3, **OVERRIDES).state_digest()
    with running_server(tmp_path / "state", model_root) as handle:
        channel = grpc.insecure_channel(handle.target)
        stub = pb_grpc.TrainingSessionServiceStub(channel)
        config_json = json.dumps(config.to_dict())
        stub.Open(pb.OpenRequest(run_id="run", config_json=config_json, max_steps=4))
        examples = codec.examples_to_proto(TEXTS[:3])
        fb = pb.ForwardBackwardRequest(
            operation=pb.Operation(operation_key="fb"), examples=examples
        )
        stub.ForwardBackward(fb)
        operation = pb.Operation(operation_key="step", include_digest=True)
        step = pb.OptimStepRequest(operation=operation, learning_rate=1e-3, **OVERRIDES)
        assert stub.OptimStep(step).result.state_digest == expected
        assert stub.OptimStep(step).result.replayed
        channel.close()

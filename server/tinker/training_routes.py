"""The SDK's training calls, as plain functions: decode, submit to the service's intake, encode.

Each route reads the call's ``(model_id, seq_id)`` and hands the intake a ``prepare`` closure:
it decodes the rest of the request into a ``Submission`` (an entry of the operation table, its
request, and what the front does with its outcome), which the intake checks when
it accepts the request and runs in seq_id order with the request id as its operation key. A
refused request still takes its seq_id (the SDK has already numbered the calls after it), so the
calls behind it are not held.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from trainwire.contract.outcomes import WeightsSource
from trainwire.server.errors import InvalidArgument
from trainwire.server.service import operations as ops
from trainwire.server.service.intake import Submission
from trainwire.server.service.loss_terms import elementwise_loss
from trainwire.server.service.requests import (
    CheckpointRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadWeightsRequest,
    OptimStepRequest,
)
from trainwire.server.service.state_dir import check_name
from trainwire.server.tinker import codec
from trainwire.server.tinker.catalog import TinkerPath, check_ttl
from trainwire.server.tinker.fields import get_bool, get_str
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.model import adam_settings
from trainwire.server.tinker.save_notes import SavedWeights


def _model_id(body: dict[str, Any]) -> str:
    return get_str(body, "model_id", "") or ""


def forward_backward(front: TinkerFront, body: bytes, content_encoding: str) -> str:
    """``forward_backward`` (or, ``forward_only``, a forward): keyed by its request id."""
    message = codec.parse_forward_backward(body, content_encoding)
    return front.submit(
        "forward_backward",
        body,
        message.model_id,
        message.seq_id,
        partial(_decode_forward_backward, message),
        encoding=content_encoding,
        size=codec.held_bytes(message),  # what its decoded datums hold until it has run
    )


def _decode_forward_backward(message: codec.pb.ForwardBackwardRequest) -> Submission:
    """The datums and the loss; a ``forward_only`` call is a forward (a read, not keyed)."""
    request = codec.forward_backward_call(message)
    encode = partial(_encode_forward_backward, request)
    examples, loss = request.examples, (request.loss_fn, request.loss_fn_config)
    if request.forward_only:
        return Submission(ops.FORWARD, ForwardRequest(examples, *loss), encode)
    return Submission(ops.FORWARD_BACKWARD, ForwardBackwardRequest(examples, *loss), encode)


def _encode_forward_backward(request: codec.ForwardBackwardCall, outcome: Any) -> bytes:
    """The SDK's ``ForwardBackwardOutput``: logprobs, each target's loss term, metrics."""
    losses = elementwise_loss(request.loss_fn, request.loss_fn_config, request.examples, outcome)
    return codec.encode_forward_backward_output(outcome.logprobs, losses, outcome.metrics)


def optim_step(front: TinkerFront, body: dict[str, Any]) -> str:
    """One update at the step's own learning rate; Tinker adds the gradients of every
    forward_backward since the last step (``sum_microbatches``)."""

    def prepare() -> Submission:
        step = OptimStepRequest(**adam_settings(body), sum_microbatches=True)
        return Submission(ops.OPTIM_STEP, step, _optim_step_output)

    return front.submit("optim_step", body, _model_id(body), body.get("seq_id"), prepare)


def _optim_step_output(outcome: Any) -> dict[str, Any]:
    metrics = {"learning_rate:mean": outcome.learning_rate, "grad_norm:mean": outcome.grad_norm}
    return {"type": "optim_step", "metrics": metrics}


def save_weights(front: TinkerFront, body: dict[str, Any]) -> str:
    """A checkpoint of the full state; this model's records in the request store are compacted
    behind it (a restart needs the sessions, the samplers and its calls since)."""
    model_id, seq_id = _model_id(body), body.get("seq_id")

    def prepare() -> Submission:
        name = check_name(get_str(body, "path", "") or "", "save_weights path")
        ttl = check_ttl(body.get("ttl_seconds"), "save_state")
        path = TinkerPath(model_id, "weights", name)

        def encode(_: Any) -> dict[str, Any]:
            return {"type": "save_weights", "path": str(path)}

        note = SavedWeights(path, name, ttl, seq_id)
        return Submission(ops.SAVE_STATE, CheckpointRequest(name), encode, note)

    return front.submit("save_weights", body, model_id, seq_id, prepare)


def load_weights(front: TinkerFront, body: dict[str, Any]) -> str:
    """This model's checkpoint: its weights, or (``optimizer``) the full state.

    Found and logged under the guard of removals and unpublishing (``saved_checkpoints``): a
    delete or an unpublish comes before it (then it is not found, 404) or after it (then it
    sees this load logged and is refused, 409, until the load's run no longer needs it), so
    at its turn the checkpoint is there as its sender found it, and its replay, which runs as
    the sender, reads it too."""
    model_id = _model_id(body)
    if not model_id and body.get("session_id") is not None:  # create_training_client_from_state
        return front.models.create_from_state(body)

    def prepare() -> Submission:
        path = TinkerPath.parse(get_str(body, "path"))
        if path.segment != "weights":
            raise InvalidArgument(f"load_state {str(path)!r}: give a training checkpoint's path")
        # A replayed request reads what it read when it was accepted, expired since or not.
        source, saved = front.catalog.find(path, expired_ok=front.intake.taking_back)
        run_id = "" if source.model_id == model_id else source.run_id

        def encode(_: Any) -> dict[str, Any]:
            return {"type": "load_weights", "path": body.get("path"), "model_id": model_id}

        if get_bool(body, "optimizer"):  # the engine restores a full state only into a fresh one
            return Submission(ops.LOAD_STATE, CheckpointRequest(saved.stored_as, run_id), encode)
        weights = LoadWeightsRequest(WeightsSource("checkpoint", saved.stored_as), run_id)
        return Submission(ops.LOAD_WEIGHTS, weights, encode)

    with front.catalog.removal_guard:
        return front.submit("load_weights", body, model_id, body.get("seq_id"), prepare)

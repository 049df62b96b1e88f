"""The SDK's training calls, as plain functions: decode, submit to the service's intake, encode.

Each route reads the call's ``(model_id, seq_id)`` and hands the intake a ``prepare`` closure:
it decodes the rest of the request into a ``Submission`` (an entry of the operation table, its
request, the name of its response's encoder in ``answers`` and its note), which the intake checks
and stores when
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
from trainwire.server.service.requests import (
    CheckpointRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadWeightsRequest,
    OptimStepRequest,
)
from trainwire.server.service.state_dir import check_name
from trainwire.server.tinker import codec, save_notes
from trainwire.server.tinker.catalog import TinkerPath, check_ttl
from trainwire.server.tinker.fields import get_bool, get_str
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.model import adam_settings
from trainwire.server.tinker.save_notes import LoadedCheckpoint, SavedWeights


def _model_id(body: dict[str, Any]) -> str:
    return get_str(body, "model_id", "") or ""


def forward_backward(front: TinkerFront, body: bytes, content_encoding: str) -> str:
    """``forward_backward`` (or, ``forward_only``, a forward): keyed by its request id."""
    message = codec.parse_forward_backward(body, content_encoding)
    return front.submit(
        body,
        message.model_id,
        message.seq_id,
        partial(_decode_forward_backward, message),
        size=codec.held_bytes(message),  # what its decoded datums hold until it has run
    )


def _decode_forward_backward(message: codec.pb.ForwardBackwardRequest) -> Submission:
    """The datums and the loss; a ``forward_only`` call is a forward (a read, not keyed)."""
    request = codec.forward_backward_call(message)
    examples, loss = request.examples, (request.loss_fn, request.loss_fn_config)
    if request.forward_only:
        return Submission(ops.FORWARD, ForwardRequest(examples, *loss), "forward_backward")
    batch = ForwardBackwardRequest(examples, *loss)
    return Submission(ops.FORWARD_BACKWARD, batch, "forward_backward")


def optim_step(front: TinkerFront, body: dict[str, Any]) -> str:
    """One update at the step's own learning rate; Tinker adds the gradients of every
    forward_backward since the last step (``sum_microbatches``)."""

    def prepare() -> Submission:
        step = OptimStepRequest(**adam_settings(body), sum_microbatches=True)
        return Submission(ops.OPTIM_STEP, step, "optim_step")

    return front.submit(body, _model_id(body), body.get("seq_id"), prepare)


def save_weights(front: TinkerFront, body: dict[str, Any]) -> str:
    """A checkpoint of the full state; this model's records in the request store are compacted
    behind it (a restart needs the sessions, the samplers and its calls since)."""
    model_id, seq_id = _model_id(body), body.get("seq_id")

    def prepare() -> Submission:
        name = check_name(get_str(body, "path", "") or "", "save_weights path")
        ttl = check_ttl(body.get("ttl_seconds"), "save_state")
        note = SavedWeights(TinkerPath(model_id, "weights", name), name, ttl, seq_id)
        request = CheckpointRequest(name)
        return Submission(ops.SAVE_STATE, request, "save_weights", save_notes.to_json(note))

    return front.submit(body, model_id, seq_id, prepare)


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
        source, saved = front.catalog.find(path)
        run_id = "" if source.model_id == model_id else source.run_id
        note = save_notes.to_json(LoadedCheckpoint(model_id, str(path)))
        if get_bool(body, "optimizer"):  # the engine restores a full state only into a fresh one
            request: Any = CheckpointRequest(saved.stored_as, run_id)
            return Submission(ops.LOAD_STATE, request, "load_weights", note)
        request = LoadWeightsRequest(WeightsSource("checkpoint", saved.stored_as), run_id)
        return Submission(ops.LOAD_WEIGHTS, request, "load_weights", note)

    with front.catalog.removal_guard:
        return front.submit(body, model_id, body.get("seq_id"), prepare)

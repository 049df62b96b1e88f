"""The SDK's responses to its training calls, by name: the encoders the intake is given.

A route names one of these for its call (``Submission.answer``); the intake stores the name with
the call and, once the operation's outcome is in, makes the response with it from the call's
typed request, its note (``save_notes``, as JSON) and the outcome, nothing else: so a call
queued again after a restart is answered as it would have been without one. A keyed call's
response is made when it is fetched (its outcome is the journal's), a forward's before its result
is stored.
"""

from __future__ import annotations

from typing import Any

from trainwire.server.service.intake import Encoder
from trainwire.server.service.loss_terms import elementwise_loss
from trainwire.server.service.requests import ForwardRequest
from trainwire.server.tinker import codec
from trainwire.server.tinker.save_notes import (
    ExternalWeights,
    LoadedCheckpoint,
    SamplerSnapshot,
    SavedWeights,
    note_of,
)

Note = dict[str, Any] | None


def forward_backward(request: ForwardRequest, _note: Note, outcome: Any) -> bytes:
    """The SDK's ``ForwardBackwardOutput``: logprobs, each target's loss term, metrics."""
    losses = elementwise_loss(request.loss_fn, request.loss_fn_config, request.examples, outcome)
    return codec.encode_forward_backward_output(outcome.logprobs, losses, outcome.metrics)


def optim_step(_request: Any, _note: Note, outcome: Any) -> dict[str, Any]:
    metrics = {"learning_rate:mean": outcome.learning_rate, "grad_norm:mean": outcome.grad_norm}
    return {"type": "optim_step", "metrics": metrics}


def save_weights(_request: Any, note: Note, _outcome: Any) -> dict[str, Any]:
    saved = _note(note, SavedWeights)
    return {"type": "save_weights", "path": str(saved.path)}


def load_weights(_request: Any, note: Note, _outcome: Any) -> dict[str, Any]:
    loaded = _note(note, LoadedCheckpoint)
    return {"type": "load_weights", "path": loaded.path, "model_id": loaded.model_id}


def save_weights_for_sampler(_request: Any, note: Note, _outcome: Any) -> dict[str, Any]:
    snapshot = _note(note, SamplerSnapshot)
    if snapshot.path:
        return {"type": "save_weights_for_sampler", "path": snapshot.path}
    return {"type": "save_weights_for_sampler", "sampling_session_id": snapshot.sampling_id}


def save_weights_external(_request: Any, note: Note, outcome: Any) -> dict[str, Any]:
    external = _note(note, ExternalWeights)
    size = sum(file.size_bytes for file in outcome.files)
    return {"type": "save_weights_external", "path": str(external.path), "size_bytes": size}


def _note(note: Note, note_type: type[Any]) -> Any:
    typed = note_of(note or {})
    if not isinstance(typed, note_type):
        raise TypeError(f"a {note_type.__name__} answers this call, not {typed!r}")
    return typed


ANSWERS: dict[str, Encoder] = {
    "forward_backward": forward_backward,
    "optim_step": optim_step,
    "save_weights": save_weights,
    "load_weights": load_weights,
    "save_weights_for_sampler": save_weights_for_sampler,
    "save_weights_external": save_weights_external,
}

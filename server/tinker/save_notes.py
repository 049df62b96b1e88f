"""The typed notes a Tinker call carries through the intake: what the front does with its outcome.

Data, not code: a route fills one in when it decodes its call, and the intake stores it with the
call as JSON (``to_json``; its ``note`` field names the type) and hands it back to the front's
encoder of the call's response (``answers``) and, once the operation applied, to its one observer
(``saves_applied.applied``). A restart reads it back from the stored call (``note_of``), so what
the front records and answers after a crash is what it would have without one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainwire.server.tinker.catalog import TinkerPath


@dataclass(frozen=True)
class SavedWeights:
    """``save_weights``: the checkpoint ``name`` of model ``path.model_id``, kept ``ttl_seconds``
    (None: until deleted); the model's request records before it are compacted."""

    path: TinkerPath
    name: str
    ttl_seconds: int | None
    seq_id: int


@dataclass(frozen=True)
class SamplerSnapshot:
    """``save_weights_for_sampler``: export ``export`` of run ``run_id`` holds a snapshot of
    model ``model_id``'s weights, named ``path`` (then a catalog entry) or for the new sampling
    session ``sampling_id`` (``inflight``: the model's inflight weights move to it)."""

    model_id: str
    run_id: str
    base_model: str
    export: str
    seq_id: int
    path: str  # "" for an unnamed snapshot
    name: str
    sampling_id: str
    ttl_seconds: int | None
    inflight: bool


@dataclass(frozen=True)
class ExternalWeights:
    """``save_weights_external``: export ``export`` offered as ``path``, kept ``ttl_seconds``,
    and only age-encrypted to ``recipients`` when any are given."""

    path: TinkerPath
    export: str
    ttl_seconds: int | None
    recipients: tuple[str, ...]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """``load_weights`` of model ``model_id`` from checkpoint ``path`` (as its caller sent it):
    a delete or re-save of that checkpoint waits until the load no longer needs it
    (``saved_checkpoints.replay_readers``); nothing is recorded once it applied."""

    model_id: str
    path: str


Note = SavedWeights | SamplerSnapshot | ExternalWeights | LoadedCheckpoint
NOTES: dict[str, type[Any]] = {
    "saved_weights": SavedWeights,
    "sampler_snapshot": SamplerSnapshot,
    "external_weights": ExternalWeights,
    "loaded_checkpoint": LoadedCheckpoint,
}
NOTE_NAMES = {note_type: name for name, note_type in NOTES.items()}


def to_json(note: Note) -> dict[str, Any]:
    """``note`` as JSON: its fields (a path as its text) and its type's name (``note``)."""
    fields: dict[str, Any] = {"note": NOTE_NAMES[type(note)]}
    for field in dataclasses.fields(note):
        value = getattr(note, field.name)
        fields[field.name] = str(value) if isinstance(value, TinkerPath) else value
    if isinstance(note, ExternalWeights):
        fields["recipients"] = list(note.recipients)
    return fields


def note_of(fields: dict[str, Any]) -> Note:
    """The note ``fields`` hold (``to_json``'s); ValueError for JSON that is none."""
    values = dict(fields)
    note_type = NOTES.get(values.pop("note", None))
    if note_type is None:
        raise ValueError(f"not a note of the Tinker front: {fields!r:.80}")
    if "path" in values and note_type in (SavedWeights, ExternalWeights):
        values["path"] = TinkerPath.parse(values["path"])
    if "recipients" in values:
        values["recipients"] = tuple(values["recipients"])
    try:
        return note_type(**values)
    except TypeError as error:
        raise ValueError(f"a stored {note_type.__name__}: {error}") from None

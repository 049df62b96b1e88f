"""What the front records once a save applied: the one observer the intake tells of them.

A Tinker save is the host's operation (``SaveState`` or ``ExportWeights``) plus what only the
Tinker API has: a catalog entry with its TTL, a sampling session's weights, age-encrypted copies,
the request store compacted behind a checkpoint. A route says which of those its call needs as a
typed note on its ``Submission`` (data, not code: ``save_notes``, stored as JSON with the call);
the intake hands each applied note to ``applied``, on the engine thread, before the next call of
any stream runs (so a sample sent after the save's answer finds its weights), and again when a
restart's replay is answered from the journal (each step here may run twice: a crash can fall
between the operation's commit and the note's effect). A load's note records nothing here.
"""

from __future__ import annotations

import shutil
from typing import Any

from trainwire.server.service import operations as ops
from trainwire.server.service.requests import DiscardExportsRequest
from trainwire.server.tinker import external_weights, saved_checkpoints
from trainwire.server.tinker.catalog import TinkerPath
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.save_notes import (
    ExternalWeights,
    LoadedCheckpoint,
    SamplerSnapshot,
    SavedWeights,
    note_of,
)
from trainwire.server.tinker.saved_checkpoints import encrypted_dir


def applied(front: TinkerFront, request_id: str, fields: dict[str, Any], outcome: Any) -> None:
    """What the note ``fields`` hold says the front records now that ``request_id``'s call
    applied (a load: nothing)."""
    note = note_of(fields)
    if isinstance(note, SavedWeights):
        _saved_weights(front, request_id, note, outcome)
    elif isinstance(note, SamplerSnapshot):
        _sampler_snapshot(front, request_id, note)
    elif isinstance(note, ExternalWeights):
        _external_weights(front, request_id, note)
    elif not isinstance(note, LoadedCheckpoint):
        raise TypeError(f"no front record follows a note of type {type(note).__name__}")


def _saved_weights(front: TinkerFront, request_id: str, note: SavedWeights, saved: Any) -> None:
    model_id = note.path.model_id
    front.intake.compact_at(model_id, note.seq_id, saved.position, front.models.head_records)
    saved_checkpoints.record_saved(front, note.path, note.name, note.ttl_seconds, request_id)


def _sampler_snapshot(front: TinkerFront, request_id: str, note: SamplerSnapshot) -> None:
    sessions = front.sampling_sessions
    version = front.host.weights_version(note.run_id)  # what the export holds
    if note.path:
        sessions.snapshot(
            note.model_id, None, note.path, note.base_model, note.export, note.seq_id, version
        )
        saved = TinkerPath(note.model_id, "sampler_weights", note.name)
        saved_checkpoints.record_saved(front, saved, note.export, note.ttl_seconds, request_id)
        return
    pruned = sessions.snapshot(
        note.model_id,
        note.sampling_id,
        None,
        note.base_model,
        note.export,
        note.seq_id,
        version,
        inflight=note.inflight,
    )
    if pruned:
        discard = DiscardExportsRequest(pruned)
        # At the snapshot's turn: accepted already, never refused for what waits.
        front.host.apply(ops.DISCARD_EXPORTS, discard, run_id=note.run_id, account=None)


def _external_weights(front: TinkerFront, request_id: str, note: ExternalWeights) -> None:
    if note.recipients:
        recipients = external_weights.parse_recipients(list(note.recipients))
        external_weights.encrypt(front, note.path, note.export, recipients)
    else:  # an earlier save under this name was encrypted: its files are not these
        shutil.rmtree(encrypted_dir(front, note.path), ignore_errors=True)
    saved_checkpoints.record_saved(front, note.path, note.export, note.ttl_seconds, request_id)

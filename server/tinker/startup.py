"""Starting and stopping the Tinker front: build its parts, give the intake its routes, read
the front's own state back, and let the calls run once the host has restored its run.

A restarted front takes its own state back from the request store before its listener serves
(``replay``): sessions, samplers, where a compacted store resumes, and the sampling sessions its
stored snapshot calls make. Then the intake queues every stored request without a recorded
result again, in its original order (``Intake.replay``): a call from its typed record, answered
by the encoder it names (``answers``), a sample through ``asample`` as its sender sent it; the
calls wait until the host's recovery is done (``Intake.recovered``).
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from pathlib import Path
from typing import Any

from trainwire.server.errors import InvalidArgument
from trainwire.server.service.host import SessionHost
from trainwire.server.service.intake import Intake
from trainwire.server.service.request_records import (
    CallRecord,
    NoteRecord,
    Record,
    ResumeRecord,
    SessionRecord,
)
from trainwire.server.service.run_owners import RunOwners
from trainwire.server.service.tenants import Tenants
from trainwire.server.tinker import (
    answers,
    external_weights,
    sampling_routes,
    saved_checkpoints,
    saves_applied,
)
from trainwire.server.tinker.catalog import Catalog
from trainwire.server.tinker.front import FRONT_DIR, TinkerFront
from trainwire.server.tinker.model_table import ModelTable
from trainwire.server.tinker.save_notes import Note, SamplerSnapshot, note_of
from trainwire.server.tinker.sdk_sessions import session_of
from trainwire.server.tinker.tenancy import calling, sender_of, tenant_of

logger = logging.getLogger(__name__)


def start_front(
    host: SessionHost,
    state_dir: Path,
    *,
    model_root: Path | None,
    tokenizer_id: str | None = None,
    tenants: Tenants | None = None,
    owners: RunOwners | None = None,
) -> TinkerFront:
    """The front of ``host``, its files in ``state_dir/tinker``, with its request store replayed
    (``tenants``' limits and the ``owners`` of run ids: ``ModelTable``)."""
    directory = Path(state_dir) / FRONT_DIR
    intake = Intake(host, owner_of=session_of, noun="model", account_of=tenant_of)
    external_weights.clean_encrypted_leftovers(directory)
    catalog = Catalog(directory)
    models = ModelTable(
        host,
        intake,
        directory,
        model_root=model_root,
        tokenizer_id=tokenizer_id,
        catalog=catalog,
        tenants=tenants,
        owners=owners,
    )
    front = TinkerFront(host, intake, models, directory, model_root, catalog)
    intake.encoders.update(answers.ANSWERS)
    intake.sample_again = partial(_sample_again, front)
    intake.applied = partial(saves_applied.applied, front)
    # Before the replay: a replayed load reads what it read, so no save may write over it.
    host.checkpoint_readers = partial(saved_checkpoints.checkpoint_readers, front)
    replay(front)
    threading.Thread(
        target=_await_recovery, args=(front,), name="tinker-recover", daemon=True
    ).start()
    return front


def stop_front(front: TinkerFront) -> None:
    front.intake.stop()


def replay(front: TinkerFront) -> None:
    """Restore the front's own state, then let the intake queue every unanswered request.
    A model whose run was closed through the gRPC port (and the server stopped before the front
    heard of it) is forgotten then, before the host's recovery is checked against the
    positions its stored calls were compacted at: a closed run is not resumed."""
    with front.intake.replaying() as records:
        for record in records:
            _restore_front_state(front, record)
        front.intake.replay(records)
    front.models.forget_closed()


def _restore_front_state(front: TinkerFront, record: Record) -> None:
    if isinstance(record, SessionRecord):
        front.models.sessions.add(record.session_id)
    elif isinstance(record, NoteRecord):
        front.sampling_sessions.restore(record)
    elif isinstance(record, ResumeRecord):
        models = {model.model_id: model.run_id for model in front.models.open_models()}
        if record.stream in models:
            front.intake.resume_at(record, run_id=models[record.stream])
    elif isinstance(record, CallRecord) and record.note is not None:
        note = _note_or_none(record)
        if isinstance(note, SamplerSnapshot) and not note.path:  # its samples wait behind it
            front.sampling_sessions.expect(note.sampling_id, note.model_id)


def _note_or_none(record: CallRecord) -> Note | None:
    """A stored call's note (None for JSON that is no note of the front's: it makes no
    sampling session to expect)."""
    try:
        return note_of(record.note or {})
    except (ValueError, InvalidArgument):
        return None


def _sample_again(front: TinkerFront, body: dict[str, Any]) -> Any:
    """A stored sample given to ``asample`` again, as the listener gave it the first time: as
    its tenant's, so what it was refused then it is refused now."""
    with calling(sender_of(body)):
        return sampling_routes.asample(front, body)


def _await_recovery(front: TinkerFront) -> None:
    """Let submitted calls run once the host restored its runs (at once when none)."""
    front.host.recover()  # queued behind serve()'s own recovery: returns once it is done
    front.intake.recovered(front.models.position_of)

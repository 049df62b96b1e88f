"""What the front does with named checkpoints beyond saving them: record them in the catalog,
delete them (at the SDK's request or past their TTL) and finish removals that had to wait.

The files are the host's: ``SessionHost.discard_saved`` removes them on its engine thread, so no
operation is reading them, and keeps the open run's recovery point until a newer checkpoint
supersedes it (the catalog remembers those, and the next save asks again).

What a run read stays readable to its replay as it was read: while an open model's logged
``load_state`` of a checkpoint is one a restart replays (``replay_readers``), the checkpoint's
owner may not delete it, unpublish it under another tenant's load (the reader was shown it
public, and its replay reads it again), nor save over it (``checkpoint_readers``, which the host
asks before a SaveState writes over a folder): each is refused (409) until the reader has saved a
checkpoint of its own or closed. A replayed load is queued from its stored request, which names
the folder it found (``request_records.CallRecord``); the load's note names the path it asked for,
which is how a delete finds it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainwire.server.errors import InUse, InvalidArgument, NotFound
from trainwire.server.service import operations as ops
from trainwire.server.tinker.catalog import SavedCheckpoint, TinkerPath
from trainwire.server.tinker.model import run_id_for
from trainwire.server.tinker.tenancy import tenant_of, unrestricted

if TYPE_CHECKING:
    from trainwire.server.tinker.front import TinkerFront

logger = logging.getLogger(__name__)

ENCRYPTED_DIR = "encrypted"  # the front's age-encrypted copies of external weights
# The operations of a stored load_state, whose replay reads a checkpoint (its note names it).
LOADS = (ops.LOAD_STATE.kind, ops.LOAD_WEIGHTS.kind)


def encrypted_dir(front: TinkerFront, path: TinkerPath) -> Path:
    """Where the encrypted files of external weights ``path`` are (if it was encrypted); by the
    path alone, since a tenant it was published to reads them but may not see the run."""
    return front.directory / ENCRYPTED_DIR / run_id_for(path.model_id) / path.name


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder`` (0 when it is gone)."""
    if not folder.is_dir():
        return 0
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def record_saved(
    front: TinkerFront, path: TinkerPath, stored_as: str, ttl_seconds: int | None, saved_by: str
) -> None:
    """Put the checkpoint request ``saved_by`` just saved (``stored_as``: the run's checkpoint
    for ``weights``, its export otherwise) in the catalog, then finish removals that waited."""
    run = front.host.state_dir.run(front.catalog.run(path.model_id).run_id)
    folder = run.checkpoint(stored_as) if path.segment == "weights" else run.export(stored_as)
    now = front.catalog.clock()
    expires = None if ttl_seconds is None else now + ttl_seconds
    size = folder_bytes(folder)
    saved = SavedCheckpoint(path.checkpoint_id, stored_as, now, size, expires, saved_by)
    replaced = front.catalog.add_checkpoint(path, saved)
    if replaced is not None and replaced.stored_as != stored_as:  # no record names it now
        front.host.discard_saved(
            front.catalog.run(path.model_id).run_id, exports=[replaced.stored_as]
        )
    if path.segment == "weights":
        finish_removals(front, path.model_id)
    sweep(front, wait=False)  # on the engine thread, after the save (``saves_applied``)


def replay_readers(front: TinkerFront, path: TinkerPath) -> list[str]:
    """The logged requests a restart would run again that read checkpoint ``path``: the open
    model's ``load_state`` calls since its last checkpoint whose result is not recorded (a
    success is the journal's, and replaying it reads the checkpoint again). A checkpoint of the
    model itself counts too: recovery restores its newest checkpoint, not an older one it
    loaded since."""
    calls, answered = front.intake.store.calls(LOADS)
    return [
        call.request_id
        for call in calls
        if call.request_id not in answered
        and call.note is not None
        and _names(call.note.get("path"), path)
    ]


def sample_readers(front: TinkerFront, path: TinkerPath) -> list[str]:
    """The samples of sampler weights ``path`` accepted and not answered yet, and those being
    accepted now (as ``"a sample being accepted"``): their turn reads its files, so they must
    stay until each has run. Every tenant's: a published checkpoint serves them all."""
    sessions = front.sampling_sessions.reading(lambda model_path: _names(model_path, path))
    waiting = front.intake.results.pending_among(
        lambda request_id: request_id.rpartition("/")[0] in sessions
    )
    accepting = front.catalog.samples_accepting[str(path)]
    return [*sorted(waiting), *["a sample being accepted"] * accepting]


def checkpoint_readers(front: TinkerFront, run_id: str, folder: str) -> list[str]:
    """The logged loads a restart would replay that read run ``run_id``'s checkpoint folder
    ``folder`` under any name the catalog gives it, as a refusal names them: a save over that
    folder would change what they read. The saving model's own loads are not among them: they
    come before its save in its order, and its restart restores the new checkpoint, from which
    its journal answers them."""
    readers: list[str] = []
    for path in front.catalog.stored_in(run_id, folder):
        own = f"{path.model_id}/"
        readers += [
            named_reader(reader, path)
            for reader in replay_readers(front, path)
            if not reader.startswith(own)
        ]
    return readers


def named_reader(request_id: str, path: TinkerPath) -> str:
    """A reader of checkpoint ``path`` as a refusal to its owner names it: by its request id
    when it is the owner's own, else without any id (another tenant's ids are not shown)."""
    if tenant_of(request_id) == tenant_of(path.model_id):
        return f"load_state {request_id!r}"
    return "a load_state of another tenant's model"


def _names(given: object, path: TinkerPath) -> bool:
    """Whether ``given`` (a request's path field, whatever it holds) is a tinker path naming
    ``path``."""
    try:
        return TinkerPath.parse(given) == path
    except InvalidArgument:
        return False


def delete(front: TinkerFront, path: TinkerPath) -> None:
    """Take ``path`` out of the catalog and remove its files (or, for the open run's recovery
    point, remember to once it is superseded).

    Refused (``InUse``, HTTP 409) while a request of the open run that a restart replays reads
    it: removing it would make that replay fail and change a result already answered."""
    front.catalog.run(path.model_id)  # another tenant's run: not found, its readers unnamed
    with front.catalog.removal_guard:
        readers = replay_readers(front, path)
        if readers:
            raise InUse(
                f"checkpoint {str(path)!r} cannot be deleted yet: "
                f"{named_reader(readers[0], path)} of an open run read it, and a restart "
                "replays that call from it; delete it once that run has saved a checkpoint "
                "(save_state) or closed"
            )
        samples = sample_readers(front, path) if path.segment == "sampler_weights" else []
        if samples:
            raise InUse(
                f"sampler weights {str(path)!r} cannot be deleted yet: {len(samples)} accepted "
                "sample(s) of them have not run; delete them once those samples are answered"
            )
        _delete(front, path)


def unpublish(front: TinkerFront, path: TinkerPath) -> None:
    """Make ``path`` its owner's alone again (its owner's call: another tenant's is NotFound).

    Refused (``InUse``, HTTP 409) while another tenant's request that a restart replays read
    it: that replay runs as its sender, would find the checkpoint private and fail, and the
    reader's run would end on other bits than those it was answered. The owner's own loads
    read it private as well, so they never hold it."""
    front.catalog.run(path.model_id)  # another tenant's run: not found, its readers unnamed
    front.catalog.find(path)
    with front.catalog.removal_guard:  # see ``delete``: a load is accepted or not, whole
        owner = tenant_of(path.model_id)
        readers = [r for r in replay_readers(front, path) if tenant_of(r) != owner]
        if readers:
            raise InUse(
                f"checkpoint {str(path)!r} cannot be unpublished yet: "
                f"{named_reader(readers[0], path)} of an open run read it while it was "
                "published, and a restart replays that call from it as that tenant; unpublish "
                "it once that run has saved a checkpoint (save_state) or closed"
            )
        front.catalog.set_public(path, False)


def _delete(front: TinkerFront, path: TinkerPath) -> None:
    record = front.catalog.run(path.model_id)
    saved = front.catalog.remove(path)
    front.sampling_sessions.forget_named(str(path))
    if path.segment == "weights":
        kept = front.host.discard_saved(record.run_id, checkpoints=[saved.stored_as])
        if kept:
            front.catalog.set_deferred(path.model_id, sorted({*record.deferred, *kept}))
    else:
        front.host.discard_saved(record.run_id, exports=[saved.stored_as])
        shutil.rmtree(encrypted_dir(front, path), ignore_errors=True)
    logger.debug("Tinker front: checkpoint %s deleted", path)


def finish_removals(front: TinkerFront, model_id: str) -> None:
    """Remove the checkpoint folders of ``model_id`` whose removal waited."""
    record = front.catalog.run(model_id)
    if record.deferred:
        kept = front.host.discard_saved(record.run_id, checkpoints=record.deferred)
        front.catalog.set_deferred(model_id, kept)


def sweep(front: TinkerFront, *, wait: bool = True) -> None:
    """Delete every checkpoint past its TTL, every tenant's (whichever request asks), under the
    removal guard. ``wait=False`` (after a save, on the engine thread) skips the sweep when
    another thread holds the guard: a delete or a copy holds it while it waits for the engine
    thread to remove or link files, so waiting for it there would stop both for good; the next
    sweep (every listing, every save) deletes what this one left."""
    guard = front.catalog.removal_guard
    if not guard.acquire(blocking=wait):
        return
    try:
        with unrestricted():
            _delete_expired(front)
    finally:
        guard.release()


def _delete_expired(front: TinkerFront) -> None:
    for path in front.catalog.expired():
        try:
            delete(front, path)
        except NotFound:  # a concurrent call's sweep removed it first
            continue
        except InUse as error:  # hidden (expired) and kept until no replay reads it
            logger.debug("Tinker front: expired %s kept for now: %s", path, error)

"""What the front does with named checkpoints beyond saving them: record them in the catalog,
delete them (at the SDK's request or past their TTL) and finish removals that had to wait.

The files are the host's: ``SessionHost.discard_saved`` removes them on its executor, so no
operation is reading them, and keeps the open run's recovery point until a newer checkpoint
supersedes it (the catalog remembers those, and the next save asks again).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainwire.server.errors import InUse, InvalidArgument, NotFound
from trainwire.server.tinker.catalog import SavedCheckpoint, TinkerPath
from trainwire.server.tinker.model import run_id_for
from trainwire.server.tinker.tenancy import unrestricted

if TYPE_CHECKING:
    from trainwire.server.tinker.front import TinkerFront

logger = logging.getLogger(__name__)

ENCRYPTED_DIR = "encrypted"  # the front's age-encrypted copies of external weights
LOAD_ROUTE = "load_weights"  # the logged route of load_state, whose replay reads a checkpoint


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
    sweep(front)


def replay_readers(front: TinkerFront, path: TinkerPath) -> list[str]:
    """The logged requests a restart would run again that read checkpoint ``path``: the open
    model's ``load_state`` calls since its last checkpoint whose result is not recorded (a
    success is the journal's, and replaying it reads the checkpoint again). A checkpoint of the
    model itself counts too: recovery restores its newest checkpoint, not an older one it
    loaded since."""
    calls, answered = front.intake.store.calls(LOAD_ROUTE)
    return [
        call.request_id
        for call in calls
        if call.request_id not in answered
        and isinstance(call.body, dict)
        and _names(call.body.get("path"), path)
    ]


def _names(given: object, path: TinkerPath) -> bool:
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
                f"checkpoint {str(path)!r} cannot be deleted yet: the open run's "
                f"load_state {readers[0]!r} read it, and a restart replays that call from it; "
                "delete it once that run has saved a checkpoint (save_state) or closed"
            )
        _delete(front, path)


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


def sweep(front: TinkerFront) -> None:
    """Delete every checkpoint past its TTL, every tenant's (whichever request asks)."""
    with unrestricted():
        _sweep(front)


def _sweep(front: TinkerFront) -> None:
    for path in front.catalog.expired():
        try:
            delete(front, path)
        except NotFound:  # a concurrent call's sweep removed it first
            continue
        except InUse as error:  # hidden (expired) and kept until no replay reads it
            logger.debug("Tinker front: expired %s kept for now: %s", path, error)

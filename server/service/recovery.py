"""Restart recovery: bring a fresh session and the run's journal back to its latest checkpoint.

The checkpoint (``run_checkpoints.latest_checkpoint``) says where the run was and which SaveState
wrote it; the journal forgets what came after it (entries are marked rolled back, so the
controller's replay runs their keys again), re-commits the SaveState if the server died between
writing the checkpoint and committing its entry, and the exports written by rolled-back operations
are removed, since they belong to a timeline the journal forgot.
"""

from __future__ import annotations

import logging
import shutil

from trainwire.server.engine.session import TrainingSession
from trainwire.server.service.journal import Journal, JournalEntry
from trainwire.server.service.requests import EXPORT_WEIGHTS_KIND, SAVE_STATE_KIND
from trainwire.server.service.run_checkpoints import RestorePoint
from trainwire.server.service.state_dir import RunDirectory

logger = logging.getLogger(__name__)


def restore_into(
    session: TrainingSession, journal: Journal, point: RestorePoint | None
) -> tuple[int, str]:
    """Load ``point`` into the fresh ``session`` and align ``journal``; (position, last key)."""
    if point is None:
        rolled = journal.roll_back_after(0)
        if rolled:
            logger.warning("no checkpoint: %d journal entries rolled back to position 0", rolled)
        return 0, ""
    session.load_state(point.path)
    key = point.server["operation_key"]
    rolled = journal.roll_back_after(point.position)
    if rolled:
        logger.info("%d journal entries after position %d rolled back", rolled, point.position)
    if journal.roll_back_others_at(point.position, key):
        # Another operation was journaled at the checkpoint's position (a save that failed after
        # its rename, by a server before this fix): the checkpoint is what the session holds.
        logger.warning("rolled back an entry at position %d that is not %r", point.position, key)
    if journal.lookup(key) is None:
        # The server died after the checkpoint was renamed into place, before the commit.
        journal.commit(point.entry(SAVE_STATE_KIND))
        logger.warning("re-committed %s %r at position %d", SAVE_STATE_KIND, key, point.position)
    return point.position, key


def drop_forgotten_exports(run: RunDirectory, journal: Journal) -> None:
    """Remove the exports whose latest writer the restart rolled back: they belong to a
    timeline the journal forgot (a replayed LoadWeights("export:e") must not read them).
    The rolled-back ExportWeights writes them again, the same bits, when it is replayed."""
    latest: dict[str, JournalEntry] = {}
    for entry in journal.entries(include_rolled_back=True):
        if entry.kind == EXPORT_WEIGHTS_KIND:
            name = entry.result.get("name", "")
            if name not in latest or entry.position >= latest[name].position:
                latest[name] = entry
    for name, entry in latest.items():
        path = run.export(name)
        if entry.rolled_back and path.exists():
            shutil.rmtree(path)
            logger.info("export %s of rolled-back operation %r removed", name, entry.operation_key)

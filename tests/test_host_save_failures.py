"""A SaveState that fails after its checkpoint is in place counts as applied: recovery would
restore that checkpoint at its position, so the journal must hold the save there, alone."""

from __future__ import annotations

import dataclasses
import sqlite3

from host_operations import BATCHES, op
from ledger_files import opened_journal

from trainwire.contract import files
from trainwire.server.service import operations as ops
from trainwire.server.service.ledger import ledger_path
from trainwire.server.service.requests import CheckpointRequest, ForwardBackwardRequest


def test_a_save_whose_directory_fsync_fails_after_the_rename_counts_as_applied(
    host, make_host, monkeypatch
):
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb-1", 0))
    checkpoints = host.state_dir.run("run").checkpoint("c").parent
    real_fsync = files.fsync_directory

    def failing_fsync(directory):
        if directory == checkpoints:
            raise OSError(5, "Input/output error (injected after the rename)")
        real_fsync(directory)

    monkeypatch.setattr(files, "fsync_directory", failing_fsync)
    saved = host.apply(ops.SAVE_STATE, CheckpointRequest("c"), op("save", 1))
    monkeypatch.setattr(files, "fsync_directory", real_fsync)
    assert saved.position == 2 and (checkpoints / "c").is_dir()
    after = host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("fb-2", 2))
    assert after.position == 3
    host.release()  # a crash

    restarted = make_host()
    info = restarted.info()
    assert (info.position, info.restored_checkpoint) == (2, "c")
    entries = restarted.journal.entries()
    assert [(e.position, e.operation_key) for e in entries] == [(1, "fb-1"), (2, "save")]
    again = restarted.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("fb-2", 2))
    assert (again.position, again.loss, again.replayed) == (3, after.loss, False)


def test_recovery_keeps_one_operation_per_position_when_a_journal_holds_two(host, make_host):
    """A journal written before saves counted as applied: the save's checkpoint is at position
    2 and another operation was journaled at 2 too. The checkpoint wins; the other runs again."""
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb-1", 0))
    host.apply(ops.SAVE_STATE, CheckpointRequest("c"), op("save", 1))
    journal = host.journal
    entry = journal.lookup("save")
    host.release()
    # Forge the old bug's journal: the save's entry gone, fb-2 journaled at its position.
    with sqlite3.connect(ledger_path(host.state_dir.root)) as db:
        db.execute("DELETE FROM operations WHERE run = 'run' AND operation_key = 'save'")
    with opened_journal(host.state_dir.root, "run") as forged:
        forged.commit(dataclasses.replace(entry, operation_key="fb-2", kind="ForwardBackward"))

    restarted = make_host()
    entries = restarted.journal.entries()
    assert [(e.position, e.operation_key) for e in entries] == [(1, "fb-1"), (2, "save")]
    assert restarted.info().position == 2

"""A session host restarted on its state directory: it restores the latest checkpoint (before it
serves), forgets the journal after it and replays to the same digest; a save whose journal entry a
crash lost is recorded again; one state directory has one host at a time.
"""

from __future__ import annotations

import sqlite3

import pytest
from host_operations import BATCHES, op, run_ops

from trainwire.contract import outcomes
from trainwire.server.errors import (
    Unavailable,
)
from trainwire.server.service import operations as ops
from trainwire.server.service.host import SessionHost
from trainwire.server.service.ledger import ledger_path
from trainwire.server.service.requests import (
    CheckpointRequest,
    ForwardBackwardRequest,
    OptimStepRequest,
)


def test_a_restarted_host_restores_its_latest_checkpoint_and_replays_to_the_same_digest(
    host, make_host
):
    run_ops(host, 0, 2)
    host.apply(ops.SAVE_STATE, CheckpointRequest("early"), op("save-early", 4))
    run_ops(host, 5, 1)
    saved = host.apply(ops.SAVE_STATE, CheckpointRequest("late"), op("save-late", 7))
    uninterrupted = run_ops(host, 8, 2)
    final = host.info()
    host.release()  # the "crash": nothing is closed, the run stays recorded open

    restarted = make_host()
    info = restarted.info()

    assert (info.position, info.restored_checkpoint, info.last_operation_key) == (
        8,
        "late",
        "save-late",
    )
    assert info.state_digest == saved.state_digest and info.step == saved.step
    assert restarted.apply(
        ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("k2", 99)
    ).replayed  # before: answered
    replayed = run_ops(restarted, 8, 2)
    assert [o.replayed for o in replayed] == [False] * 4  # rolled back: they ran again
    assert replayed == uninterrupted
    assert restarted.info().state_digest == final.state_digest


def test_recovery_re_records_a_save_whose_journal_entry_a_crash_lost(host, make_host):
    run_ops(host, 0, 1)
    saved = host.apply(ops.SAVE_STATE, CheckpointRequest("c1"), op("save", 2))
    host.release()
    db = sqlite3.connect(ledger_path(host.state_dir.root))
    with db:  # as if the server died between the checkpoint's rename and the journal commit
        db.execute("DELETE FROM operations WHERE run = 'run' AND operation_key = 'save'")
    db.close()

    restarted = make_host()

    assert restarted.info().position == 3
    assert restarted.apply(
        ops.SAVE_STATE, CheckpointRequest("c1"), op("save", 2)
    ) == outcomes.CheckpointOutcome("save", 3, True, saved.state_digest, name="c1", step=1)


def test_recovery_without_a_checkpoint_starts_fresh_at_position_zero(host, make_host):
    fresh_digest = host.info().state_digest
    run_ops(host, 0, 2)
    host.release()

    restarted = make_host()

    info = restarted.info()
    assert (info.position, info.step, info.restored_checkpoint) == (0, 0, "")
    assert info.state_digest == fresh_digest
    assert restarted.journal.entries() == []
    assert not run_ops(restarted, 0, 1)[0].replayed


def test_a_host_on_a_state_dir_with_an_open_run_restores_before_it_serves(
    host, tmp_path, model_root
):
    run_ops(host, 0, 1)
    host.apply(ops.SAVE_STATE, CheckpointRequest("c1"), op("save", 2))
    host.release()
    serving: list[bool] = []

    restarted = SessionHost(
        tmp_path / "state", model_root=model_root, device="cpu", on_serving=serving.append
    )
    try:
        assert restarted.info().state == outcomes.RESTORING and restarted.info().run_id == "run"
        with pytest.raises(Unavailable, match="restoring"):
            restarted.apply(ops.OPTIM_STEP, OptimStepRequest(), op("k"))
        restarted.recover()

        assert serving == [False, True]
        assert (restarted.info().state, restarted.info().position) == (outcomes.OPEN, 3)
    finally:
        restarted.release()


def test_a_second_host_on_the_same_state_directory_is_refused(host, tmp_path, model_root):
    with pytest.raises(OSError, match="another server is using the state directory"):
        SessionHost(tmp_path / "state", model_root=model_root, device="cpu")

    host.release()
    SessionHost(tmp_path / "state", model_root=model_root, device="cpu").release()


def test_a_discarded_runs_journal_goes_with_its_files(host, host_config):
    """Removing a closed run (a copy nobody was answered with) deletes its rows of the ledger
    too: a run opened later under its id starts with no keys, so its first key runs."""
    first = host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb", 0))
    host.close("run")
    host.discard_copy("run")
    assert not host.state_dir.run("run").path.exists()

    host.open("run", host_config, 10, "sha256:plan")
    again = host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("fb", 0))

    assert not again.replayed and again.position == 1 and again.loss != first.loss
    assert [e.operation_key for e in host.journal.entries(include_rolled_back=True)] == ["fb"]

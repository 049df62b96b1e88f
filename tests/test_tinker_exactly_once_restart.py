"""Exactly once across a SIGKILL of a real ``trainwire serve --tinker-listen`` process: a result
whose poll response was lost is answered again after a compaction and the kill, and a logged call
the restarted front cannot take again fails alone instead of keeping the server from starting."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_files import opened_store, stored_call, stored_save
from test_tinker_restart import TinkerServeProcess
from tinker_loops import RawFront

from trainwire.server.tinker.codec import PROTOBUF
from trainwire.testing import free_port


@pytest.mark.slow
def test_a_lost_poll_response_is_answered_again_after_a_compaction_and_a_sigkill(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Item 3 with a real kill: a forward_backward's result handed to a poll whose response is
    lost, a save that compacts the log, a SIGKILL: the restarted server answers the SDK's
    retried poll with the same bytes."""
    port, state_dir = free_port(), tmp_path / "state"
    started: list[TinkerServeProcess] = []
    try:
        started.append(TinkerServeProcess(tmp_path, state_dir, model_root, port, "first"))
        api = RawFront(f"http://127.0.0.1:{port}")
        _, model_id = api.model()
        request_id = api.forward_backward(model_id, 1).json()["request_id"]
        lost = api.poll(request_id)
        assert lost.headers["content-type"] == PROTOBUF
        saved = api.post("save_weights", {"model_id": model_id, "seq_id": 2, "path": "kept"})
        assert "path" in api.poll(saved.json()["request_id"]).json()
        started[0].kill()
        started.append(TinkerServeProcess(tmp_path, state_dir, model_root, port, "second"))
        assert api.poll(request_id).content == lost.content
    finally:
        for process in started:
            process.kill()


@pytest.mark.slow
def test_a_record_the_restarted_front_cannot_replay_fails_alone_and_the_server_starts(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Item 5 with a real kill: after the SIGKILL the log holds a call of an operation this
    version does not have; ``trainwire serve`` still starts, that call fails with a ``server``
    error, and the call after it runs."""
    port, state_dir = free_port(), tmp_path / "state"
    started: list[TinkerServeProcess] = []
    try:
        started.append(TinkerServeProcess(tmp_path, state_dir, model_root, port, "first"))
        api = RawFront(f"http://127.0.0.1:{port}")
        _, model_id = api.model()
        started[0].kill()
        with opened_store(state_dir) as log:
            log.write(stored_call(f"{model_id}/1", "from_a_newer_version", {}, "optim_step"))
            log.write(stored_save(model_id, 2, "after"))
        started.append(TinkerServeProcess(tmp_path, state_dir, model_root, port, "second"))
        failed = api.poll(f"{model_id}/1").json()
        assert failed["category"] == "server" and "from_a_newer_version" in failed["error"]
        assert api.poll(f"{model_id}/2").json()["path"].endswith("/weights/after")
    finally:
        for process in started:
            process.kill()

"""A checkpoint that the open run's journaled ``load_state`` read stays until that run no longer
needs it: a restart replays the load from it, so deleting it (or letting its TTL remove it) would
change the run's history and a result already answered. The delete is refused (409) with the
reason; past its TTL it is hidden and kept; once the run saves a checkpoint, both go ahead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from test_tinker_restart import TinkerServeProcess
from tinker_loops import KEY, RawFront, tinker_server

from trainwire.server.tinker.catalog import SavedCheckpoint
from trainwire.server.tinker.codec import PROTOBUF
from trainwire.server.tinker.model import run_id_for
from trainwire.testing import free_port

ADAM = {"learning_rate": 0.05}


def checkpoint_folder(state_dir: Path, model_id: str, name: str) -> Path:
    return state_dir / "runs" / run_id_for(model_id) / "checkpoints" / name


def delete(api: RawFront, model_id: str, name: str) -> httpx.Response:
    url = f"{api.base}/training_runs/{model_id}/checkpoints/weights/{name}"
    return httpx.delete(url, headers={"X-API-Key": KEY}, timeout=60)


def done(api: RawFront, response: httpx.Response) -> dict[str, Any]:
    """The JSON result of an accepted call (``{}`` for a protobuf one); fails the test on a
    refusal or a failed call."""
    assert response.status_code == 200, response.text
    result = api.poll(response.json()["request_id"])
    assert result.status_code == 200, result.text
    if result.headers["content-type"] == PROTOBUF:
        return {}
    body = result.json()
    assert "error" not in body, body
    return body


def step(api: RawFront, model_id: str, seq_id: int, last_token: int) -> None:
    """A forward_backward (``seq_id``) and an optim_step (``seq_id + 1``), awaited."""
    done(api, api.forward_backward(model_id, seq_id, tokens=(3, 4, 5, 6, last_token)))
    optim = {"model_id": model_id, "seq_id": seq_id + 1, "adam_params": ADAM}
    done(api, api.post("optim_step", optim))


def saved_run(api: RawFront, name: str = "ck", ttl_seconds: int | None = None) -> tuple[str, str]:
    """Run A: one step, a checkpoint ``name``, its session finished (the run closed). Returns
    (A's model id, the checkpoint's tinker path)."""
    session_id, model_id = api.model()
    step(api, model_id, 1, 9)
    save = {"model_id": model_id, "seq_id": 3, "path": name, "ttl_seconds": ttl_seconds}
    path = done(api, api.post("save_weights", save))["path"]
    assert api.post(f"sessions/{session_id}/finish", {}).status_code == 200
    return model_id, path


def trained_from(api: RawFront, source: str) -> tuple[str, str, dict[str, Any]]:
    """Run B: load_state of ``source``, then two steps without saving. Returns (B's model id,
    the load's request id, its answer)."""
    _, model_id = api.model()
    load = api.post("load_weights", {"model_id": model_id, "seq_id": 1, "path": source})
    answer = done(api, load)
    step(api, model_id, 2, 7)
    step(api, model_id, 4, 8)
    return model_id, load.json()["request_id"], answer


@pytest.mark.slow
def test_a_checkpoint_a_journaled_load_read_is_kept_across_a_sigkill_until_its_reader_saves(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """The review's reproducer: run B loads closed run A's checkpoint and trains two steps
    unsaved; the delete of A's checkpoint is refused with the reason; after a SIGKILL the
    replayed load reads it again, B ends where it was with the same digest, and the load's
    request id answers what it answered before. Once B saves, the delete goes ahead."""
    port, state_dir = free_port(), tmp_path / "state"
    started: list[TinkerServeProcess] = []
    try:
        started.append(TinkerServeProcess(tmp_path, state_dir, model_root, port, "first"))
        api = RawFront(f"http://127.0.0.1:{port}")
        source_model, source = saved_run(api)
        model_id, load_id, answer = trained_from(api, source)
        digest = started[0].state_digest()

        refused = delete(api, source_model, "ck")
        assert refused.status_code == 409, refused.text
        assert f"load_state {load_id!r}" in refused.json()["detail"]
        assert "save_state" in refused.json()["detail"]
        assert checkpoint_folder(state_dir, source_model, "ck").is_dir()

        started[0].kill()
        started.append(TinkerServeProcess(tmp_path, state_dir, model_root, port, "second"))
        assert api.poll(load_id).json() == answer
        api.poll(f"{model_id}/5")  # the last replayed call
        assert started[1].state_digest() == digest

        save = {"model_id": model_id, "seq_id": 6, "path": "own"}
        done(api, api.post("save_weights", save))
        assert delete(api, source_model, "ck").status_code == 204
        assert not checkpoint_folder(state_dir, source_model, "ck").exists()
    finally:
        for process in started:
            process.kill()


def test_an_expired_checkpoint_a_journaled_load_read_is_hidden_but_replayed_from(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TTL expiry is a removal too: past its TTL the checkpoint is hidden (listed nowhere, no
    new load finds it) but kept while B's load replays from it; a restart replays that load
    (the checkpoint still expired then) to the same digest; B's save lets the sweep remove it."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = RawFront(handle.tinker.base_url)
        source_model, source = saved_run(api, ttl_seconds=3600)
        model_id, load_id, answer = trained_from(api, source)
        digest, position = handle.session_host.info().state_digest, handle.session_host.position

    monkeypatch.setattr(SavedCheckpoint, "expired", lambda self, now: True)  # its TTL passed
    with tinker_server(state_dir, model_root) as handle:
        api = RawFront(handle.tinker.base_url)
        assert api.poll(load_id).json() == answer
        api.poll(f"{model_id}/5")  # the last replayed call
        assert handle.session_host.position == position
        assert handle.session_host.info().state_digest == digest
        listed = api.post("weights_info", {"tinker_path": source})  # sweeps first
        assert listed.status_code == 404, listed.text
        assert checkpoint_folder(state_dir, source_model, "ck").is_dir()  # kept for the replay
        again = api.post("load_weights", {"model_id": model_id, "seq_id": 6, "path": source})
        assert again.status_code == 404 and "deleted or expired" in again.json()["detail"]

        save = {"model_id": model_id, "seq_id": 7, "path": "own"}
        done(api, api.post("save_weights", save))  # sweeps after it is recorded
        assert not checkpoint_folder(state_dir, source_model, "ck").exists()


def test_a_load_whose_logged_body_is_left_on_disk_still_keeps_its_checkpoint(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """A load padded past the request log's in-memory bound (its body stays in the file) is
    found all the same: the delete is refused."""
    with tinker_server(tmp_path / "state", model_root) as handle:
        api = RawFront(handle.tinker.base_url)
        source_model, source = saved_run(api)
        _, model_id = api.model()
        padded = {"model_id": model_id, "seq_id": 1, "path": source, "padding": "x" * 8192}
        load = api.post("load_weights", padded)
        done(api, load)
        refused = delete(api, source_model, "ck")
        assert refused.status_code == 409, refused.text
        assert load.json()["request_id"] in refused.json()["detail"]

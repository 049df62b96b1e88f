"""A Tinker model's run closed through the gRPC port (``trainwire close``) is closed for the
Tinker front too: the front answers for it as for a model its client closed, lists it nowhere,
gives its slot to a new model, and a restart neither resumes it nor logs an error about it; the
other runs go on."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from service_fixtures import connect
from test_tinker_exactly_once import save
from tinker_loops import KEY, SENTENCES, RawFront, lora_training, tinker_server, train_step

from trainwire import cli
from trainwire.contract.model_ids import run_id_for
from trainwire.server.process import ServerHandle

# Servers of many runs, closed through both ports and restarted: with the slow tests.
pytestmark = pytest.mark.slow

LORA = {"base_model": "llama", "lora_config": {"rank": 4}}


def lora_model(api: RawFront) -> tuple[str, str]:
    """A new session and its LoRA model, over raw HTTP (no client closes it on exit)."""
    session_id = api.post("create_session", {}).json()["session_id"]
    created = api.post("create_model", {"session_id": session_id, **LORA})
    assert created.status_code == 200, created.text
    return session_id, created.json()["model_id"]


def trained(api: RawFront, model_id: str, seq_id: int) -> None:
    """A forward_backward of ``model_id`` at ``seq_id``, answered."""
    answer = api.poll(api.forward_backward(model_id, seq_id).json()["request_id"])
    assert answer.status_code == 200, answer.text


def trainwire_close(handle: ServerHandle, run: str, key_file: Path) -> None:
    """``trainwire close --run-id RUN`` against the server's gRPC port, as an operator runs it
    (with the key both ports share)."""
    key_file.write_text(KEY + "\n")
    target = f"127.0.0.1:{handle.port}"
    assert (
        cli.main(["close", "--server", target, "--run-id", run, "--token-file", str(key_file)]) == 0
    )


def test_a_grpc_close_of_a_tinker_models_run_closes_the_model_for_the_front(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Closed through gRPC, the SDK's model answers as one its client closed (404, the same
    detail), its session lists it no more, and its slot takes a new model at once."""
    with lora_training(tmp_path / "state", model_root, max_runs=2) as run:
        train_step(run, SENTENCES[0])
        model_id = run.training.model_id
        api = RawFront(run.handle.tinker.base_url)
        other_session, other = lora_model(api)
        assert api.post(f"sessions/{other_session}/finish").status_code == 200
        closed_by_its_client = api.post("get_info", {"model_id": other})
        assert closed_by_its_client.status_code == 404

        client = connect(run.handle, token=KEY)
        client.close(run_id=run_id_for(model_id))
        client.close_channel()

        info = api.post("get_info", {"model_id": model_id})
        assert info.status_code == 404
        detail = closed_by_its_client.json()["detail"].replace(other, model_id)
        assert info.json()["detail"] == detail
        step = api.forward_backward(model_id, 3)
        assert step.status_code == 404 and step.json()["detail"] == detail
        session = run.service.holder.get_session_id()
        listed = httpx.get(f"{api.base}/sessions/{session}", headers={"X-API-Key": KEY})
        assert listed.status_code == 200 and listed.json()["open_model_ids"] == []
        # Both slots free: two new models open at once (the closed one held none).
        opened = [lora_model(api)[1] for _ in range(2)]
        trained(api, opened[1], 1)


def test_a_closed_models_run_is_closed_for_grpc_too(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """The other way round: the SDK closing its client closes the run for the gRPC port."""
    with lora_training(tmp_path / "state", model_root, max_runs=2) as run:
        train_step(run, SENTENCES[0])
        run_id = run_id_for(run.training.model_id)
        client = connect(run.handle, token=KEY)
        assert [info.run_id for info in client.runs()] == [run_id]
        run.service.close("success").result(timeout=30)
        assert client.runs() == []
        assert client.close(run_id=run_id).state == "closed"  # closed already: a no-op
        client.close_channel()


def test_a_tinker_model_closed_with_trainwire_close_is_not_resumed_at_a_restart(
    tmp_path: Path, model_root: Path, tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model that saved state (its calls compacted at that checkpoint), closed with
    ``trainwire close`` and the server restarted before the front heard of it: no ERROR, the
    model is gone, and the model beside it goes on from where it was."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root, max_runs=2) as handle:
        api = RawFront(handle.tinker.base_url)
        _, closing = lora_model(api)
        _, staying = lora_model(api)
        trained(api, closing, 1)
        assert "path" in save(api, closing, 2, "saved")  # compacts the closing model's calls
        trained(api, staying, 1)
        trainwire_close(handle, closing, tmp_path / "key")
    caplog.clear()
    with caplog.at_level(logging.INFO), tinker_server(state_dir, model_root, max_runs=2) as handle:
        api = RawFront(handle.tinker.base_url)
        trained(api, staying, 2)  # runs once the host has recovered (and the front checked it)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []
        assert handle.session_host.position_of(run_id_for(staying)) == 2
        assert api.post("get_info", {"model_id": closing}).status_code == 404
        assert not (state_dir / "tinker" / "models" / f"{run_id_for(closing)}.json").exists()

"""Named checkpoints through the real Tinker SDK: the catalog every run and its checkpoints stay
in after the run's session ends (RestClient lists, gets, deletes and expires them), across a
server restart, and the slot rule that one live client's model holds the server."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import tinker
from service_fixtures import wait_for
from test_tinker_request_log import FrontApi  # raw calls, no SDK retries
from tinker_loops import (
    KEY,
    SENTENCES,
    SdkRun,
    lora_training,
    service_client,
    supervised_datum,
    tinker_server,
    train_step,
)

from trainwire.server.process import ServerHandle
from trainwire.server.tinker.model import run_id_for

METADATA = {"renderer": "llama3", "experiment": "checkpoints"}
HOUR = 3600


def rest_client(handle: ServerHandle) -> tinker.RestClient:
    return tinker.RestClient(base_url=handle.tinker.base_url, api_key=KEY)


def checkpoint_folders(state_dir: Path, model_id: str) -> list[str]:
    """The run's checkpoint folders on disk (``runs/<run_id>/checkpoints/``)."""
    folder = state_dir / "runs" / run_id_for(model_id) / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def move_clock(handle: ServerHandle, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The catalog's clock ``seconds`` ahead, as if that much time had passed."""
    catalog = handle.tinker.front.catalog
    monkeypatch.setattr(catalog, "clock", lambda: time.time() + seconds)


def close_enough(when: datetime | None, expected: datetime) -> bool:
    return when is not None and abs(when - expected) < timedelta(seconds=60)


def test_saved_checkpoints_are_listed_with_their_kind_path_expiry_and_run_metadata(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with tinker_server(tmp_path / "state", model_root) as handle:
        service = service_client(handle)
        training = service.create_lora_training_client(
            base_model="llama", rank=4, train_unembed=False, user_metadata=METADATA
        ).result()
        model_id = training.model_id
        train_step(SdkRun(handle, service, training, training.get_tokenizer()), SENTENCES[0])
        state = training.save_state("mid", ttl_seconds=2 * HOUR).result().path
        sampler = training.save_weights_for_sampler("mid-sampler").result().path
        assert state == f"tinker://{model_id}/weights/mid"
        assert sampler == f"tinker://{model_id}/sampler_weights/mid-sampler"
        rest = rest_client(handle)

        listed = rest.list_checkpoints(model_id).result().checkpoints
        assert [(c.checkpoint_type, c.checkpoint_id, c.tinker_path) for c in listed] == [
            ("training", "weights/mid", state),
            ("sampler", "sampler_weights/mid-sampler", sampler),
        ]
        now = datetime.now(UTC)
        assert close_enough(listed[0].expires_at, now + timedelta(hours=2))
        assert listed[1].expires_at is None
        assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
        assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == [
            sampler,  # newest first
            state,
        ]

        run = rest.get_training_run(model_id).result()
        assert run == rest.get_training_run_by_tinker_path(state).result()
        assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (
            model_id,
            "llama",
            True,
            4,
        )
        assert run.user_metadata == METADATA
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
        assert run.last_sampler_checkpoint is not None
        assert run.last_sampler_checkpoint.tinker_path == sampler

        info = rest.get_weights_info_by_tinker_path(state).result()
        assert (info.base_model, info.is_lora, info.lora_rank) == ("llama", True, 4)
        assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, False)


def test_list_training_runs_pages_through_every_run_newest_first(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with tinker_server(tmp_path / "state", model_root) as handle:
        api, created = FrontApi(handle), []
        for _ in range(3):
            session_id = api.session()
            created.append(api.create_model(session_id, lora_rank=4).json()["model_id"])
            assert api.post(f"sessions/{session_id}/finish").status_code == 200
        rest = rest_client(handle)
        first = rest.list_training_runs(limit=2, offset=0).result()
        rest_page = rest.list_training_runs(limit=2, offset=2).result()
        assert [r.training_run_id for r in first.training_runs + rest_page.training_runs] == (
            created[::-1]
        )
        assert (first.cursor.offset, first.cursor.limit, first.cursor.total_count) == (0, 2, 3)
        assert (rest_page.cursor.offset, rest_page.cursor.total_count) == (2, 3)
        with pytest.raises(tinker.BadRequestError, match="limit"):
            rest.list_training_runs(limit=0).result()


def test_deleting_a_checkpoint_removes_it_and_the_open_runs_newest_waits_for_the_next_save(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with lora_training(state_dir, model_root) as run:
        training, model_id, rest = run.training, run.training.model_id, rest_client(run.handle)
        older = training.save_state("older").result().path
        train_step(run, SENTENCES[0])
        newest = training.save_state("newest").result().path
        sampler = training.save_weights_for_sampler("sampler").result().path
        assert {"older", "newest"} <= set(checkpoint_folders(state_dir, model_id))

        rest.delete_checkpoint_from_tinker_path(older).result()
        assert "older" not in checkpoint_folders(state_dir, model_id)  # removed at once
        rest.delete_checkpoint_from_tinker_path(newest).result()
        rest.delete_checkpoint_from_tinker_path(sampler).result()
        assert rest.list_checkpoints(model_id).result().checkpoints == []
        assert rest.list_user_checkpoints().result().checkpoints == []
        for path in (older, newest, sampler):
            with pytest.raises(tinker.NotFoundError, match="deleted or expired"):
                rest.get_weights_info_by_tinker_path(path).result()
            with pytest.raises(tinker.NotFoundError):
                rest.delete_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError, match="deleted or expired"):
            run.service.create_sampling_client(model_path=sampler).result()
        with pytest.raises(tinker.NotFoundError, match="deleted or expired"):
            run.service.create_training_client_from_state(older).result()
        # The newest checkpoint is the run's recovery point: hidden now, removed once superseded.
        assert "newest" in checkpoint_folders(state_dir, model_id)
        train_step(run, SENTENCES[1])
        training.save_state("later").result()
        folders = checkpoint_folders(state_dir, model_id)
        assert "newest" not in folders and "later" in folders
        assert [c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints] == [
            "weights/later"
        ]


def test_a_checkpoint_past_its_ttl_is_gone_and_an_out_of_range_ttl_is_refused(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"
    with lora_training(state_dir, model_root) as run:
        training, model_id, rest = run.training, run.training.model_id, rest_client(run.handle)
        short = training.save_state("short").result().path
        kept = training.save_state("kept", ttl_seconds=3 * HOUR).result().path
        for ttl in (HOUR - 1, 10 * 365 * 24 * HOUR + 1):
            with pytest.raises(tinker.BadRequestError, match="between 3600"):
                rest.set_checkpoint_ttl_from_tinker_path(short, ttl).result()
        with pytest.raises(tinker.BadRequestError, match="between 3600"):
            training.save_state("bad-ttl", ttl_seconds=60).result()
        rest.set_checkpoint_ttl_from_tinker_path(short, HOUR).result()
        listed = {c.tinker_path: c for c in rest.list_checkpoints(model_id).result().checkpoints}
        assert close_enough(listed[short].expires_at, datetime.now(UTC) + timedelta(hours=1))
        assert close_enough(listed[kept].expires_at, datetime.now(UTC) + timedelta(hours=3))

        move_clock(run.handle, monkeypatch, HOUR + 1)
        assert [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints] == [
            kept
        ]
        assert "short" not in checkpoint_folders(state_dir, model_id)  # its files went too
        with pytest.raises(tinker.NotFoundError, match="deleted or expired"):
            rest.get_weights_info_by_tinker_path(short).result()
        with pytest.raises(tinker.NotFoundError):
            rest.set_checkpoint_ttl_from_tinker_path(short, HOUR).result()
        rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()  # never expires now
        move_clock(run.handle, monkeypatch, 100 * HOUR)
        (still,) = rest.list_checkpoints(model_id).result().checkpoints
        assert (still.tinker_path, still.expires_at) == (kept, None)


def test_a_restarted_server_keeps_its_runs_and_checkpoints_and_starts_runs_from_them(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        service = service_client(handle)
        training = service.create_lora_training_client(
            base_model="llama", rank=4, user_metadata=METADATA
        ).result()
        model_id, tokenizer = training.model_id, training.get_tokenizer()
        train_step(SdkRun(handle, service, training, tokenizer), SENTENCES[0])
        path = training.save_state("mid").result().path
        sampler = training.save_weights_for_sampler("mid-sampler").result().path
        datum = supervised_datum(tokenizer, SENTENCES[1])
        before = training.forward([datum], "cross_entropy").result().loss_fn_outputs
        listed = rest_client(handle).list_checkpoints(model_id).result().checkpoints
    with tinker_server(state_dir, model_root) as handle:
        rest = rest_client(handle)
        (kept,) = rest.list_training_runs().result().training_runs
        assert (kept.training_run_id, kept.user_metadata) == (model_id, METADATA)
        assert rest.list_checkpoints(model_id).result().checkpoints == listed
        assert [c.tinker_path for c in listed] == [path, sampler]
        service = service_client(handle)
        restarted = service.create_training_client_from_state(path).result()
        after = restarted.forward([datum], "cross_entropy").result().loss_fn_outputs
        assert [o["logprobs"].tolist() for o in after] == [o["logprobs"].tolist() for o in before]
        assert rest.list_training_runs().result().cursor.total_count == 2


def test_one_live_clients_model_holds_the_server_503_for_others_400_for_itself(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        api = FrontApi(run.handle)
        other = api.create_model(api.session(), lora_rank=4)
        assert other.status_code == 503
        assert "of another client" in other.json()["detail"]
        assert "gives way once that client has sent nothing for 30 s" in other.json()["detail"]
        again = api.create_model(run.service.holder.get_session_id(), 1, lora_rank=4)
        assert again.status_code == 400
        assert "already trains model" in again.json()["detail"]
        train_step(run, SENTENCES[0])  # the open model is untouched
        assert run.handle.session_host.info().step == 1


def test_bad_user_metadata_is_refused_before_anything_opens(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with tinker_server(tmp_path / "state", model_root) as handle:
        api = FrontApi(handle)
        session_id = api.session()
        for metadata in ({"renderer": 3}, ["not", "an", "object"], {"k": "x" * 5000}):
            body = {"session_id": session_id, "base_model": "llama", "user_metadata": metadata}
            refused = api.post("create_model", body)
            assert refused.status_code == 400 and "user_metadata" in refused.json()["detail"]
            assert handle.session_host.open_run_id is None  # nothing opened, nothing listed
        assert api.create_model(session_id, lora_rank=4).status_code == 200  # the next create opens


def test_a_save_that_finds_a_checkpoint_expired_while_a_delete_waits_for_the_engine_ends(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete (or a copy) holds the catalog's removal guard while the engine thread removes
    (or links) its files; a save's catalog record, on the engine thread, sweeps expired
    checkpoints. The sweep after a save passes over the guard while another thread holds it
    instead of waiting for it (the two waited for each other for good before), and the next
    listing deletes what it left."""
    with lora_training(tmp_path / "state", model_root) as run:
        training, model_id, rest = run.training, run.training.model_id, rest_client(run.handle)
        front, engine = run.handle.tinker.front, run.handle.session_host.scheduler
        short = training.save_state("short", ttl_seconds=HOUR).result().path
        move_clock(run.handle, monkeypatch, HOUR + 1)  # "short" is past its TTL now
        gate, saved = threading.Event(), []
        engine.run_unordered(lambda: gate.wait(60))  # the engine busy: the save waits its turn
        save = threading.Thread(target=lambda: saved.append(training.save_state("new").result()))
        save.start()
        wait_for(lambda: front.intake.results.pending_among(lambda r: r.startswith(model_id)))
        with front.catalog.removal_guard:  # as a delete holds it while the engine works for it
            gate.set()
            save.join(60)  # the save's turn ends while the guard is held elsewhere
            assert saved and saved[0].path.endswith("/weights/new")
        listed = [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints]
        assert short not in listed and listed[-1].endswith("/weights/new")

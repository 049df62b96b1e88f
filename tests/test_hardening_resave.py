"""Saving again under a name already used: the catalog's record is the new save's (its time, size
and TTL), and external weights saved first encrypted, then not, download as the new plain files,
never as the old encryption. A replayed save keeps its first record (exactly once)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pyrage
from test_tinker_checkpoints import rest_client
from tinker_loops import SENTENCES, lora_training, train_step

from trainwire.server.tinker.catalog import SavedCheckpoint, TinkerPath


def test_a_second_save_under_a_name_replaces_its_record_a_replay_keeps_it(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        model_id, rest = run.training.model_id, rest_client(run.handle)
        first = run.training.save_state("ck", ttl_seconds=3600).result().path
        (before,) = rest.list_checkpoints(model_id).result().checkpoints
        assert before.expires_at is not None
        train_step(run, SENTENCES[0])
        assert run.training.save_state("ck").result().path == first  # no TTL this time
        (after,) = rest.list_checkpoints(model_id).result().checkpoints
        assert after.expires_at is None and after.time > before.time

        catalog = run.handle.tinker.front.catalog
        path = TinkerPath.parse(first)
        _, saved = catalog.find(path)
        replayed = SavedCheckpoint(
            saved.checkpoint_id, saved.stored_as, 1.0, 1, None, saved.saved_by
        )
        assert catalog.add_checkpoint(path, replayed) is None  # the same request again
        assert catalog.find(path)[1] == saved


def test_external_weights_saved_plain_over_an_encrypted_save_download_as_the_plain_files(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    identity = pyrage.x25519.Identity.generate()
    with lora_training(tmp_path / "state", model_root) as run:
        rest, training = rest_client(run.handle), run.training
        recipients = [str(identity.to_public())]
        sealed = training.save_weights_external("out", age_encryption_recipients=recipients)
        path = sealed.result().path
        assert all(
            name.endswith(".age") for name in rest.get_external_weights_urls(path).result().urls
        )
        train_step(run, SENTENCES[0])
        assert training.save_weights_external("out").result().path == path
        urls = rest.get_external_weights_urls(path).result().urls
        assert urls and not any(name.endswith(".age") for name in urls)
        run_id = run.handle.tinker.front.catalog.run(training.model_id).run_id
        folder = run.handle.session_host.state_dir.run(run_id).export("external-out")
        for name, url in urls.items():
            assert httpx.get(url, timeout=60).content == (folder / name).read_bytes()

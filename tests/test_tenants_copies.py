"""``copy_weights`` between tenants: every tenant copies its own checkpoint or a published one
into a copy of its own; a copy that fails leaves no run folder, listing entry or claim behind;
a copy of encrypted external weights offers only the encrypted files its source offers, never
the plaintext behind them."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyrage
import pytest
import tinker
from test_tenants_tinker import ALICE, API, BOB, Front, tenant_server
from tinker_loops import close_quietly

from trainwire.server.process import ServerHandle
from trainwire.server.service.run_owners import OWNERS_FILE
from trainwire.server.service.state_dir import RUNS_DIR, StateDirectory
from trainwire.server.tinker.catalog import TinkerPath
from trainwire.server.tinker.model import run_id_for
from trainwire.server.tinker.saved_checkpoints import encrypted_dir

# Real SDK runs copied across tenants on servers of many runs: with the slow tests.
pytestmark = pytest.mark.slow


@contextlib.contextmanager
def training_client(handle: ServerHandle, key: str) -> Iterator[Any]:
    """A rank-4 LoRA training client of the tenant holding ``key``, from the real SDK."""
    service = tinker.ServiceClient(base_url=handle.tinker.base_url, api_key=key)
    try:
        yield service.create_lora_training_client(base_model="llama", rank=4).result()
    finally:
        close_quietly(service)


def rest(handle: ServerHandle, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=handle.tinker.base_url, api_key=key)


def run_ids(front: Front) -> set[str]:
    """The training runs a tenant's listing holds."""
    answer = front.send("GET", f"{API}/training_runs", params={"limit": 100})
    assert answer.status_code == 200, answer.text
    return {run["training_run_id"] for run in answer.json()["training_runs"]}


def what_is_kept(handle: ServerHandle, fronts: list[Front]) -> dict[str, Any]:
    """Everything a copy could leave behind: the run folders (hidden ones too), the encrypted
    folders, the owners of run ids, the catalog's files and every tenant's listing."""
    state = handle.session_host.state_dir.root
    directory = handle.tinker.front.directory
    owners = state / OWNERS_FILE
    return {
        "runs": sorted(p.name for p in (state / RUNS_DIR).iterdir()),
        "encrypted": sorted(str(p.relative_to(directory)) for p in directory.glob("encrypted/*/*")),
        "owners": json.loads(owners.read_text()) if owners.is_file() else {},
        "catalog": sorted(p.name for p in (directory / "catalog").iterdir()),
        "listings": [sorted(run_ids(front)) for front in fronts],
    }


def copy(front: Front, source: str, key: str) -> httpx.Response:
    body = {"source_path": source, "destination_project_id": "archive"}
    headers = {"X-Idempotency-Key": key}
    return front.send("POST", f"{API}/copy_weights", json=body, headers=headers)


def test_every_tenant_copies_its_own_checkpoint_or_a_published_one(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with tenant_server(tmp_path / "state", model_root) as handle:
        alice, bob = Front(handle, ALICE), Front(handle, BOB)
        with training_client(handle, ALICE) as training:
            weights = training.save_state("mine").result().path
            snap = training.save_weights_for_sampler("snap").result().path
        alices_copy = rest(handle, ALICE).copy_weights(weights, "archive").result()
        assert TinkerPath.parse(alices_copy).checkpoint_id == "weights/mine"
        copy_run = TinkerPath.parse(alices_copy).model_id
        assert copy_run in run_ids(alice) and copy_run not in run_ids(bob)

        with pytest.raises(tinker.NotFoundError):  # alice's, not published: not bob's to read
            rest(handle, BOB).copy_weights(snap, "archive").result()
        snap_run = f"{API}/training_runs/{TinkerPath.parse(snap).model_id}"
        published = alice.send("POST", f"{snap_run}/checkpoints/sampler_weights/snap/publish")
        assert published.status_code == 204, published.text
        bobs_copy = rest(handle, BOB).copy_weights(snap, "archive").result()
        bobs_run = TinkerPath.parse(bobs_copy).model_id
        assert bobs_run in run_ids(bob) and bobs_run not in run_ids(alice)
        for front, path, status in (
            (bob, bobs_copy, 200),
            (alice, bobs_copy, 404),
            (alice, alices_copy, 200),
            (bob, alices_copy, 404),
        ):
            info = front.send("POST", f"{API}/weights_info", json={"tinker_path": path})
            assert info.status_code == status, (path, info.text)
        listed = bob.send("GET", f"{API}/checkpoints").json()["checkpoints"]
        assert [c["tinker_path"] for c in listed] == [bobs_copy]
        owners = json.loads((handle.session_host.state_dir.root / OWNERS_FILE).read_text())
        assert owners[run_id_for(copy_run)] == "alice"
        assert owners[run_id_for(bobs_run)] == "bob"


def test_a_copy_that_fails_leaves_no_run_listing_or_claim_behind(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with tenant_server(tmp_path / "state", model_root) as handle:
        alice, bob = Front(handle, ALICE), Front(handle, BOB)
        with training_client(handle, ALICE) as training:
            snap = training.save_weights_for_sampler("snap").result().path
            mine = training.save_state("mine").result().path
        before = what_is_kept(handle, [alice, bob])
        refused = copy(bob, mine, "bobs-key")  # alice's, not published
        assert refused.status_code == 404, refused.text
        assert what_is_kept(handle, [alice, bob]) == before

        # The sampler weights' files are lost on disk while the catalog still lists them: the
        # copy fails once its run is being written, and takes every step back.
        front = handle.tinker.front
        source, saved = front.catalog.find(TinkerPath.parse(snap))
        shutil.rmtree(handle.session_host.state_dir.run(source.run_id).export(saved.stored_as))
        for _ in range(2):  # and again under the same key: still nothing left
            failed = copy(alice, snap, "alices-key")
            assert failed.status_code == 404 and "no longer on disk" in failed.text
            assert what_is_kept(handle, [alice, bob]) == before
        made = copy(alice, mine, "another-key")  # the next copy is made as ever
        assert made.status_code == 200, made.text


def test_a_run_a_copy_was_building_or_removing_when_killed_is_gone_at_the_next_start(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "state" / RUNS_DIR
    for hidden in (".copied.tmp-k2j4", ".copied.tmp-discarded"):
        (runs / hidden / "checkpoints" / "first").mkdir(parents=True)
        (runs / hidden / "run.json").write_text("{}")
    (runs / "kept" / "checkpoints").mkdir(parents=True)
    state = StateDirectory(tmp_path / "state")
    try:
        assert sorted(p.name for p in runs.iterdir()) == ["kept"]
    finally:
        state.release()


def test_a_copy_of_encrypted_external_weights_serves_only_the_encrypted_files(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    identity = pyrage.x25519.Identity.generate()
    with tenant_server(tmp_path / "state", model_root) as handle:
        alice = Front(handle, ALICE)
        with training_client(handle, ALICE) as training:
            recipients = [str(identity.to_public())]
            saving = training.save_weights_external("sealed", age_encryption_recipients=recipients)
            sealed = saving.result().path
        source = TinkerPath.parse(sealed)
        checkpoint = f"{API}/training_runs/{source.model_id}/checkpoints/{source.checkpoint_id}"
        published = alice.send("POST", f"{checkpoint}/publish")
        assert published.status_code == 204, published.text
        state_dir = handle.session_host.state_dir
        export = state_dir.run(run_id_for(source.model_id)).export("external-sealed")
        plain = {
            str(p.relative_to(export)): p.read_bytes() for p in export.rglob("*") if p.is_file()
        }
        sources_urls = rest(handle, ALICE).get_external_weights_urls(sealed).result().urls
        offered = {name: httpx.get(url, timeout=60).content for name, url in sources_urls.items()}
        assert set(offered) == {f"{name}.age" for name in plain}

        copied = rest(handle, BOB).copy_weights(sealed, "archive").result()
        urls = rest(handle, BOB).get_external_weights_urls(copied).result().urls
        assert set(urls) == set(offered)
        for name, url in urls.items():
            served = httpx.get(url, timeout=60).content
            assert served == offered[name]
            assert served not in plain.values()
            assert pyrage.decrypt(served, [identity]) == plain[name.removesuffix(".age")]
        copy_run = state_dir.run(run_id_for(TinkerPath.parse(copied).model_id))
        kept = [p.read_bytes() for p in copy_run.path.rglob("*") if p.is_file()]
        assert not any(data in kept for data in plain.values())  # no plaintext in the copy

        again = rest(handle, BOB).copy_weights(copied, "archive").result()  # a copy's copy
        urls = rest(handle, BOB).get_external_weights_urls(again).result().urls
        assert {name: httpx.get(url, timeout=60).content for name, url in urls.items()} == offered

        rest(handle, BOB).delete_checkpoint_from_tinker_path(copied).result()
        assert not encrypted_dir(handle.tinker.front, TinkerPath.parse(copied)).exists()
        again = rest(handle, ALICE).get_external_weights_urls(sealed).result().urls
        for name, url in again.items():
            assert httpx.get(url, timeout=60).content == offered[name]  # the source's, as before


def test_a_copy_whose_record_cannot_be_written_takes_back_its_run_and_encrypted_files(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    recipients = [str(pyrage.x25519.Identity.generate().to_public())]
    with tenant_server(tmp_path / "state", model_root) as handle:
        alice = Front(handle, ALICE)
        with training_client(handle, ALICE) as training:
            sealed = training.save_weights_external("sealed", age_encryption_recipients=recipients)
            source = sealed.result().path
            session = training.model_id.split(":")[0]
            body = {"source_path": source, "session_id": session, "model_seq_id": 5}
            copy_run = run_id_for(f"{session}:train:5")
            # Where the copy's catalog record goes stands a folder: its one write fails once
            # the files and the run are in place.
            blocked = handle.tinker.front.directory / "catalog" / f"{copy_run}.json"
            (blocked / "in-the-way").mkdir(parents=True)
            before = what_is_kept(handle, [alice])
            failed = alice.send("POST", f"{API}/copy_weights", json=body)
            assert failed.status_code == 500, failed.text
            assert what_is_kept(handle, [alice]) == before
            assert not handle.session_host.state_dir.run(copy_run).path.exists()
            shutil.rmtree(blocked)
            made = alice.send("POST", f"{API}/copy_weights", json=body)
            assert made.status_code == 200, made.text
            assert copy_run in what_is_kept(handle, [alice])["runs"]

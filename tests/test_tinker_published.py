"""A published checkpoint: readable by every tenant of the server (weights_info, download,
sampling, loading), still its owner's alone to unpublish, delete and list; the flag survives a
restart, and unpublishing hides it again."""

from __future__ import annotations

from pathlib import Path

from test_tenants_tinker import ALICE, API, BOB, Front, sample_body, tenant_server, train_and_save


def test_a_published_checkpoint_is_read_by_every_tenant_and_stays_its_owners(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with tenant_server(state_dir, model_root) as handle:
        alice, bob = Front(handle, ALICE), Front(handle, BOB)
        mine = train_and_save(alice)
        weights, external = mine.path(mine.checkpoint), "external_weights/out"
        urls_route = f"{mine.run_path}/checkpoints/{external}/external_weights_urls"
        assert (
            bob.send("POST", f"{API}/weights_info", json={"tinker_path": weights}).status_code
            == 404
        )
        for checkpoint in (mine.checkpoint, "sampler_weights/snap", external):
            published = alice.send("POST", f"{mine.run_path}/checkpoints/{checkpoint}/publish")
            assert published.status_code == 204, published.text
        info = bob.send("POST", f"{API}/weights_info", json={"tinker_path": weights})
        assert info.status_code == 200 and info.json()["lora_rank"] == 4
        urls = bob.send("GET", urls_route).json()["urls"]
        name, url = next(iter(urls.items()))
        assert (
            bob.send("GET", url).content
            == alice.send("GET", alice.send("GET", urls_route).json()["urls"][name]).content
        )
        # Bob samples alice's published sampler weights on a sampling session of his own.
        bob_session = bob.post("create_session", {})["session_id"]
        sampling = {
            "session_id": bob_session,
            "sampling_session_seq_id": 0,
            "model_path": mine.sampler_path,
        }
        sampler = bob.post("create_sampling_session", sampling)["sampling_session_id"]
        assert bob.result(bob.post("asample", sample_body(sampler)))
        # Still alice's: bob can neither take it back nor delete it, nor sees it in his lists.
        for verb, route in (("DELETE", "publish"), ("DELETE", ""), ("PUT", "ttl")):
            path = f"{mine.run_path}/checkpoints/{mine.checkpoint}" + (f"/{route}" if route else "")
            answer = bob.send(verb, path, json={"ttl_seconds": None})
            assert answer.status_code == 404, (verb, route, answer.text)
        assert bob.send("GET", f"{API}/checkpoints").json()["checkpoints"] == []
        saved = alice.send("GET", f"{mine.run_path}/checkpoints").json()["checkpoints"]
        assert {c["checkpoint_id"]: c["public"] for c in saved} == {
            "weights/first": True,
            "sampler_weights/snap": True,
            "external_weights/out": True,
        }
        alice.send("DELETE", f"{mine.run_path}/checkpoints/sampler_weights/snap/publish")
        hidden = bob.send("POST", f"{API}/weights_info", json={"tinker_path": mine.sampler_path})
        assert hidden.status_code == 404
        alice.post(f"sessions/{mine.session}/finish", {})
        # With alice's model closed, bob starts a model of his own from her published weights.
        model = {"session_id": bob_session, "base_model": "llama", "lora_config": {"rank": 4}}
        created = bob.post("create_model", model)
        load = {"model_id": created["model_id"], "seq_id": 1, "path": weights}
        loaded = bob.result(bob.post("load_weights", load))
        assert loaded.get("path") == weights, loaded
    with tenant_server(state_dir, model_root) as handle:  # the flag is the catalog's: it stays
        bob = Front(handle, BOB)
        for path, status in ((weights, 200), (mine.sampler_path, 404)):
            answer = bob.send("POST", f"{API}/weights_info", json={"tinker_path": path})
            assert answer.status_code == status, (path, answer.text)

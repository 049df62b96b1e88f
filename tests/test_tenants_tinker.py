"""Tenants on the Tinker front: another tenant's session, model, sampling session, future,
checkpoint and download answer 404 on every route, with the body a missing one gets; listings
show only the caller's; a wrong key is 401; the owner still reaches all of its own.

Every route of the app must be in ``ROUTES`` (a route added later fails the coverage test
until its case is written)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from service_fixtures import running_server
from tinker.proto import tinker_public_pb2 as pb

from trainwire.server.process import ServerHandle
from trainwire.server.service.tenants import Tenant, Tenants

ALICE, BOB, WRONG = "tml-alice-key", "tml-bob-key", "tml-nobody"
TENANTS = Tenants([Tenant("alice", ALICE), Tenant("bob", BOB)])
GHOST_SESSION = "tw-0123456789abcdef.bob"  # a session of bob's that does not exist
API = "/api/v1"


def tenant_server(
    state_dir: Path, model_root: Path, **keys: Any
) -> contextlib.AbstractContextManager[ServerHandle]:
    """A server with the Tinker front, under ``TENANTS`` unless other keys are given."""
    options = keys or {"tenants": TENANTS}
    return running_server(state_dir, model_root, tinker_listen="127.0.0.1:0", **options)


@dataclass(frozen=True)
class Ids:
    """What a tenant made, named as the front handed it out."""

    session: str
    model: str = ""
    sampler: str = ""  # a sampling session
    future: str = ""  # a request id
    checkpoint: str = ""  # weights/<name>
    sampler_path: str = ""  # tinker://.../sampler_weights/<name>
    url: str = ""  # a signed download URL

    def ghost(self) -> Ids:
        """The same ids under a session that does not exist (bob's, so nothing is hidden)."""
        fields = {k: v.replace(self.session, GHOST_SESSION) for k, v in vars(self).items()}
        return Ids(**fields)

    @property
    def run_path(self) -> str:
        return f"{API}/training_runs/{self.model}"

    def path(self, checkpoint_id: str) -> str:
        return f"tinker://{self.model}/{checkpoint_id}"


class Front:
    """Raw HTTP to the front under one key."""

    def __init__(self, handle: ServerHandle, key: str | None) -> None:
        self.base = handle.tinker.base_url
        self.headers = {"X-API-Key": key} if key else {}

    def send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url = path if path.startswith("http") else f"{self.base}{path}"
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.request(method, url, headers=headers, timeout=60, **kwargs)

    def post(self, route: str, body: Any) -> Any:
        answer = self.send("POST", f"{API}/{route}", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def result(self, future: dict[str, Any]) -> Any:
        while True:
            answer = self.send("POST", f"{API}/retrieve_future", json=future)
            assert answer.status_code == 200, answer.text
            if answer.headers["content-type"].startswith("application/json"):
                if answer.json().get("type") == "try_again":
                    continue
                return answer.json()
            return answer.content


def forward_backward_body(model_id: str, seq_id: int) -> bytes:
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1, 2, 3], np.int32).tobytes()
    tensor = datum.loss_fn_inputs["target_tokens"]
    tensor.dtype = pb.DTYPE_INT64
    tensor.dense = np.asarray([2, 3, 4], np.int64).tobytes()
    tensor.shape.append(3)
    return message.SerializeToString()


def train_and_save(alice: Front) -> Ids:
    """Alice's model with a training checkpoint, named sampler weights, external weights and
    their download URL, a sampling session and a sample."""
    session = alice.post("create_session", {})["session_id"]
    created = alice.post(
        "create_model",
        {"session_id": session, "base_model": "llama", "lora_config": {"rank": 4}},
    )
    model = created["model_id"]
    alice.result(created)
    step = alice.send("POST", f"{API}/forward_backward", content=forward_backward_body(model, 1))
    assert step.status_code == 200, step.text
    alice.result(step.json())
    future = alice.post("save_weights", {"model_id": model, "seq_id": 2, "path": "first"})
    assert alice.result(future)["path"] == f"tinker://{model}/weights/first"
    # A load a restart would replay: deleting "first" is refused (409, naming the load) until
    # the next save_state; another tenant must not even learn that.
    load = {"model_id": model, "seq_id": 3, "path": f"tinker://{model}/weights/first"}
    alice.result(alice.post("load_weights", load))
    snap = {"model_id": model, "seq_id": 4, "path": "snap"}
    sampler_path = alice.result(alice.post("save_weights_for_sampler", snap))["path"]
    external = {"model_id": model, "seq_id": 5, "path": "out"}
    alice.result(alice.post("save_weights_external", external))
    urls = alice.send(
        "GET", f"{API}/training_runs/{model}/checkpoints/external_weights/out/external_weights_urls"
    ).json()["urls"]
    sampling = {"session_id": session, "sampling_session_seq_id": 0, "model_path": sampler_path}
    sampler = alice.post("create_sampling_session", sampling)["sampling_session_id"]
    sample = alice.post("asample", sample_body(sampler))
    assert alice.result(sample)
    return Ids(
        session,
        model,
        sampler,
        future["request_id"],
        "weights/first",
        sampler_path,
        next(iter(urls.values())),
    )


def sample_body(sampler: str) -> dict[str, Any]:
    return {
        "sampling_session_id": sampler,
        "seq_id": 1,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2, "seed": 7},
    }


# Each route: the requests that name another tenant's things ((method, path, httpx options),
# built from the owner's ids and bob's own session), or None for a route that names nothing
# of anyone's (its listings are checked apart).
Request = tuple[str, str, dict[str, Any]]
Cases = Callable[[Ids, str], list[Request]]


def _json(route: str, body: dict[str, Any]) -> Request:
    return ("POST", f"{API}/{route}", {"json": body})


ROUTES: dict[tuple[str, str], Cases | None] = {
    ("GET", "/openapi.json"): None,
    ("POST", f"{API}/client/config"): None,
    ("GET", f"{API}/healthz"): None,
    ("GET", f"{API}/get_server_capabilities"): None,
    ("POST", f"{API}/create_session"): None,
    ("POST", f"{API}/telemetry"): None,
    ("GET", f"{API}/training_runs"): None,
    ("GET", f"{API}/checkpoints"): None,
    ("POST", f"{API}/session_heartbeat"): lambda a, b: [
        _json("session_heartbeat", {"session_id": a.session})
    ],
    ("POST", f"{API}/sessions/{{session_id}}/finish"): lambda a, b: [
        ("POST", f"{API}/sessions/{a.session}/finish", {})
    ],
    ("POST", f"{API}/create_model"): lambda a, b: [
        _json("create_model", {"session_id": a.session, "base_model": "llama", "model_seq_id": 7})
    ],
    ("POST", f"{API}/get_info"): lambda a, b: [_json("get_info", {"model_id": a.model})],
    ("POST", f"{API}/forward_backward"): lambda a, b: [
        ("POST", f"{API}/forward_backward", {"content": forward_backward_body(a.model, 9)})
    ],
    ("POST", f"{API}/optim_step"): lambda a, b: [
        _json("optim_step", {"model_id": a.model, "seq_id": 9, "adam_params": {}})
    ],
    ("POST", f"{API}/save_weights"): lambda a, b: [
        _json("save_weights", {"model_id": a.model, "seq_id": 9, "path": "mine"})
    ],
    ("POST", f"{API}/load_weights"): lambda a, b: [
        _json("load_weights", {"model_id": a.model, "seq_id": 9, "path": a.path(a.checkpoint)}),
        _json("load_weights", {"session_id": b, "path": a.path(a.checkpoint), "seq_id": 1}),
    ],
    ("POST", f"{API}/save_weights_for_sampler"): lambda a, b: [
        _json("save_weights_for_sampler", {"model_id": a.model, "seq_id": 9, "path": "mine"})
    ],
    ("POST", f"{API}/save_weights_external"): lambda a, b: [
        _json("save_weights_external", {"model_id": a.model, "seq_id": 9, "path": "mine"})
    ],
    ("POST", f"{API}/create_sampling_session"): lambda a, b: [
        _json("create_sampling_session", {"session_id": a.session, "sampling_session_seq_id": 5}),
        _json(
            "create_sampling_session",
            {"session_id": b, "sampling_session_seq_id": 5, "model_path": a.sampler_path},
        ),
    ],
    ("GET", f"{API}/samplers/{{sampling_id}}"): lambda a, b: [
        ("GET", f"{API}/samplers/{a.sampler}", {})
    ],
    ("POST", f"{API}/asample"): lambda a, b: [_json("asample", sample_body(a.sampler))],
    ("POST", f"{API}/retrieve_future"): lambda a, b: [
        _json("retrieve_future", {"request_id": a.future})
    ],
    ("POST", f"{API}/create_custom_loss"): None,
    ("POST", f"{API}/cancel_future"): lambda a, b: [
        _json("cancel_future", {"request_id": a.future})
    ],
    ("POST", f"{API}/copy_weights"): lambda a, b: [
        _json("copy_weights", {"source_path": a.path(a.checkpoint), "destination_project_id": "p"}),
        _json("copy_weights", {"source_path": a.sampler_path, "session_id": b, "model_seq_id": 9}),
    ],
    ("GET", f"{API}/training_runs/{{model_id}}"): lambda a, b: [("GET", a.run_path, {})],
    ("GET", f"{API}/training_runs/{{model_id}}/checkpoints"): lambda a, b: [
        ("GET", f"{a.run_path}/checkpoints", {})
    ],
    ("DELETE", f"{API}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}"): lambda a, b: [
        ("DELETE", f"{a.run_path}/checkpoints/{a.checkpoint}", {})
    ],
    ("PUT", f"{API}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}/ttl"): lambda a, b: [
        ("PUT", f"{a.run_path}/checkpoints/{a.checkpoint}/ttl", {"json": {"ttl_seconds": None}})
    ],
    ("POST", f"{API}/weights_info"): lambda a, b: [
        _json("weights_info", {"tinker_path": a.path(a.checkpoint)})
    ],
    (
        "GET",
        f"{API}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}/external_weights_urls",
    ): lambda a, b: [
        ("GET", f"{a.run_path}/checkpoints/external_weights/out/external_weights_urls", {})
    ],
    (
        "POST",
        f"{API}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}/publish",
    ): lambda a, b: [("POST", f"{a.run_path}/checkpoints/{a.checkpoint}/publish", {})],
    (
        "DELETE",
        f"{API}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}/publish",
    ): lambda a, b: [("DELETE", f"{a.run_path}/checkpoints/{a.checkpoint}/publish", {})],
    ("GET", f"{API}/sessions"): None,
    ("POST", f"{API}/sessions/search"): None,
    ("GET", f"{API}/sessions/{{session_id}}"): lambda a, b: [
        ("GET", f"{API}/sessions/{a.session}", {})
    ],
    ("GET", f"{API}/sessions/{{session_id}}/trace_export"): lambda a, b: [
        ("GET", f"{API}/sessions/{a.session}/trace_export", {})
    ],
    ("PUT", f"{API}/sessions/{{session_id}}/project"): lambda a, b: [
        ("PUT", f"{API}/sessions/{a.session}/project", {"json": {"project_id": "p"}})
    ],
    ("POST", f"{API}/client/dynamic_config"): None,
    ("POST", f"{API}/auth/token"): None,
    ("GET", f"{API}/auth/apikey/me"): None,
    ("DELETE", f"{API}/auth/apikey/me"): None,
    ("GET", f"{API}/billing/usage/checkpoints/current"): None,
    ("GET", f"{API}/billing/usage/events"): None,
    ("GET", f"{API}/audit"): None,
    ("POST", f"{API}/retrieve_futures"): lambda a, b: [
        _json("retrieve_futures", {"target": {"sampling_session_id": a.sampler}, "timeout": 0})
    ],
    ("POST", f"{API}/join_sampling_session"): lambda a, b: [
        _json("join_sampling_session", {"sampling_session_id": a.sampler})
    ],
    # A signed URL is its own credential; with a key, only its tenant's (see the download test).
    ("GET", f"{API}/weights_files/{{token}}"): lambda a, b: [("GET", a.url, {})],
}


def test_every_route_of_the_front_has_its_tenant_case() -> None:
    from trainwire.server.tinker.app import create_app

    app = create_app(None, token=TENANTS)  # type: ignore[arg-type]  # routes only, never called
    served = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}
    assert served == set(ROUTES), "a route without a tenant case: add it to ROUTES"


def assert_hidden(bob: Front, alice_ids: Ids, bob_session: str) -> None:
    """Every route naming alice's things answers bob 404, as for things that do not exist."""
    ghost = alice_ids.ghost()
    for (_, route), cases in ROUTES.items():
        if cases is None or route.endswith("{token}"):
            continue
        for (verb, path, options), (_, ghost_path, ghost_options) in zip(
            cases(alice_ids, bob_session), cases(ghost, bob_session), strict=True
        ):
            answer = bob.send(verb, path, **options)
            missing = bob.send(verb, ghost_path, **ghost_options)
            assert answer.status_code == 404, (route, answer.status_code, answer.text)
            assert answer.status_code == missing.status_code, route
            assert answer.text == missing.text.replace(GHOST_SESSION, alice_ids.session), route


def assert_listings_hold_only_own(front: Front, own: Ids | None, other: Ids) -> None:
    runs = front.send("GET", f"{API}/training_runs").json()
    checkpoints = front.send("GET", f"{API}/checkpoints").json()
    assert other.session not in f"{runs}{checkpoints}"
    if own is None:
        assert runs["training_runs"] == [] and checkpoints["checkpoints"] == []
    else:
        assert [run["training_run_id"] for run in runs["training_runs"]] == [own.model]
        assert len(checkpoints["checkpoints"]) == 3


def test_another_tenants_things_are_not_found_anywhere_and_its_owner_keeps_them(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with tenant_server(state_dir, model_root) as handle:
        alice, bob = Front(handle, ALICE), Front(handle, BOB)
        mine = train_and_save(alice)
        assert ".alice" in mine.session
        bob_session = bob.post("create_session", {})["session_id"]
        busy = bob.send(
            "POST", f"{API}/create_model", json={"session_id": bob_session, "base_model": "llama"}
        )
        assert busy.status_code == 503 and mine.model not in busy.text  # one server, one model
        position = handle.session_host.info().position
        assert_hidden(bob, mine, bob_session)
        assert_listings_hold_only_own(bob, None, mine)
        assert handle.session_host.info().position == position  # nothing of bob's ran
        for (method, route), cases in ROUTES.items():  # a wrong key is 401 on every route
            path = route if cases is None else cases(mine, bob_session)[0][1]
            assert Front(handle, WRONG).send(method, path).status_code == 401, route
        # Alice still has everything (bob's calls changed nothing of hers).
        assert alice.post("get_info", {"model_id": mine.model})["model_id"] == mine.model
        assert alice.result({"request_id": mine.future})["path"].endswith("/weights/first")
        assert_listings_hold_only_own(alice, mine, Ids(bob_session))
        alice.post(f"sessions/{mine.session}/finish", {})
        assert_hidden(bob, mine, bob_session)  # closed: the catalog keeps hers, hidden from bob
    with tenant_server(state_dir, model_root) as handle:  # owners survive a restart
        bob = Front(handle, BOB)
        bob_session = bob.post("create_session", {})["session_id"]
        assert_hidden(bob, replace(mine, url=""), bob_session)
        assert_listings_hold_only_own(bob, None, mine)
        assert_listings_hold_only_own(Front(handle, ALICE), mine, Ids(bob_session))


def test_a_signed_download_answers_its_tenant_or_no_key_and_404_for_another(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with tenant_server(tmp_path / "state", model_root) as handle:
        alice, bob = Front(handle, ALICE), Front(handle, BOB)
        mine = train_and_save(alice)
        file = alice.send("GET", mine.url)
        assert file.status_code == 200 and file.content
        assert Front(handle, None).send("GET", mine.url).content == file.content  # urllib's way
        refused = bob.send("GET", mine.url)
        assert Front(handle, WRONG).send("GET", mine.url).status_code == 401
        alice.send("DELETE", f"{mine.run_path}/checkpoints/external_weights/out")
        gone = alice.send("GET", mine.url)
        assert (refused.status_code, refused.text) == (404, gone.text)  # as a deleted one's


def test_a_tenant_named_default_owns_what_a_single_key_server_saved(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with tenant_server(state_dir, model_root, token=ALICE, tinker_token=ALICE) as handle:
        before = Front(handle, ALICE)
        session = before.post("create_session", {})["session_id"]
        created = before.post("create_model", {"session_id": session, "base_model": "llama"})
        model = created["model_id"]
        before.result(before.post("save_weights", {"model_id": model, "seq_id": 1, "path": "a"}))
    tenants = Tenants([Tenant("default", ALICE), Tenant("bob", BOB)])
    with tenant_server(state_dir, model_root, tenants=tenants) as handle:
        owner, bob = Front(handle, ALICE), Front(handle, BOB)
        runs = owner.send("GET", f"{API}/training_runs").json()["training_runs"]
        assert [run["training_run_id"] for run in runs] == [model]
        assert bob.send("GET", f"{API}/training_runs").json()["training_runs"] == []
        assert bob.send("GET", f"{API}/training_runs/{model}").status_code == 404
        assert owner.send("GET", f"{API}/training_runs/{model}").status_code == 200
        for name in ("session_heartbeat",):
            assert owner.send("POST", f"{API}/{name}", json={"session_id": session}).is_success
            assert (
                bob.send("POST", f"{API}/{name}", json={"session_id": session}).status_code == 404
            )


def test_a_request_refused_as_its_senders_stays_refused_after_a_restart(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """A restart queues a stored call again from its record, outside any HTTP request: bob's
    load of alice's checkpoint, refused when he sent it (404), is answered the same refusal
    after the restart, and nothing was loaded into his run (not run unrestricted)."""
    with tenant_server(tmp_path / "state", model_root) as handle:
        alice, bob = Front(handle, ALICE), Front(handle, BOB)
        session = alice.post("create_session", {})["session_id"]
        model = alice.post("create_model", {"session_id": session, "base_model": "llama"})
        saved = {"model_id": model["model_id"], "seq_id": 1, "path": "first"}
        path = alice.result(alice.post("save_weights", saved))["path"]
        alice.post(f"sessions/{session}/finish", {})
        bob_session = bob.post("create_session", {})["session_id"]
        mine = bob.post("create_model", {"session_id": bob_session, "base_model": "llama"})
        load = {"model_id": mine["model_id"], "seq_id": 1, "path": path}
        assert bob.send("POST", f"{API}/load_weights", json=load).status_code == 404
    with tenant_server(tmp_path / "state", model_root) as handle:
        answer = Front(handle, BOB).result({"request_id": f"{mine['model_id']}/1"})
        assert answer["category"] == "user" and "no checkpoint" in answer["error"]
        assert handle.session_host.info().position == 0  # nothing loaded into bob's run


def test_on_a_server_of_many_runs_tenants_train_side_by_side_and_see_only_their_own(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """``max_runs=2``: bob's model opens beside alice's (no 503 waiting for her to close), each
    tenant's routes still answer 404 for the other's things and its listings hold only its own;
    a third model is 429 (the SDK retries it) naming the limit; a tenant's ``max_runs`` caps its
    own models."""
    tenants = Tenants([Tenant("alice", ALICE), Tenant("bob", BOB, max_runs=1)])
    with tenant_server(tmp_path / "state", model_root, tenants=tenants, max_runs=2) as handle:
        alice, bob = Front(handle, ALICE), Front(handle, BOB)
        mine = train_and_save(alice)
        bob_session = bob.post("create_session", {})["session_id"]
        lora = {"base_model": "llama", "lora_config": {"rank": 4}}
        created = bob.post("create_model", {"session_id": bob_session, **lora})
        bobs = created["model_id"]
        step = bob.send("POST", f"{API}/forward_backward", content=forward_backward_body(bobs, 1))
        assert bob.result(step.json())
        second = {"session_id": bob_session, "model_seq_id": 1, **lora}
        capped = bob.send("POST", f"{API}/create_model", json=second)
        assert capped.status_code == 400 and "at most 1 open run" in capped.text
        assert_hidden(bob, mine, bob_session)
        assert alice.send("POST", f"{API}/get_info", json={"model_id": bobs}).status_code == 404
        fetch = alice.send("POST", f"{API}/retrieve_future", json=step.json())
        assert fetch.status_code == 404
        bob_runs = bob.send("GET", f"{API}/training_runs").json()["training_runs"]
        assert [run["training_run_id"] for run in bob_runs] == [bobs]
        assert_listings_hold_only_own(alice, mine, Ids(bob_session))
        third = {"session_id": mine.session, "model_seq_id": 1, **lora}
        full = alice.send("POST", f"{API}/create_model", json=third)
        assert full.status_code == 429 and "--max-runs" in full.text
        assert alice.post("get_info", {"model_id": mine.model})["model_id"] == mine.model

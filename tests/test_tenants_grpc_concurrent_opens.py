"""Tenants on the gRPC port, Opens at once: a tenant's ``max_runs`` and a server of one run hold
for Opens sent together (the count, the check and the claim are made with the open itself),
so a tenant cannot take more slots than its share by sending its Opens at once, and a loser is
never told another tenant's run id."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import LoraSettings, SessionClient
from trainwire.server.service.tenants import Tenant, Tenants

KEYS = {"alice": "alice-key", "bob": "bob-key", "carol": "carol-key"}


def tenants(**max_runs: int) -> Tenants:
    return Tenants([Tenant(name, key, max_runs.get(name)) for name, key in KEYS.items()])


def open_together(opens: list[tuple[SessionClient, str]], config) -> list[str | grpc.RpcError]:
    """Every ``client.open(run_id, config)`` sent at the same moment (threads behind one
    barrier); each one's run id, or the error it got."""
    barrier = threading.Barrier(len(opens))

    def send(client: SessionClient, run_id: str) -> str | grpc.RpcError:
        barrier.wait()
        try:
            return client.open(run_id, config).run_id
        except grpc.RpcError as error:
            return error

    with ThreadPoolExecutor(len(opens)) as pool:
        return list(pool.map(lambda pair: send(*pair), opens))


def clients(handle, *names: str) -> list[SessionClient]:
    return [connect(handle, token=KEYS[name], retry=NO_RETRY) for name in names]


def refusals(answers: list[str | grpc.RpcError]) -> list[grpc.RpcError]:
    return [answer for answer in answers if isinstance(answer, grpc.RpcError)]


def test_three_opens_at_once_of_a_one_run_tenant_open_one(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    config = llama_config(lora=LoraSettings(r=4, alpha=8))
    keys = tenants(alice=1)
    with running_server(tmp_path / "state", model_root, tenants=keys, max_runs=3) as handle:
        alices = clients(handle, "alice", "alice", "alice")
        answers = open_together([(c, f"alice-{i}") for i, c in enumerate(alices)], config)
        opened = [answer for answer in answers if isinstance(answer, str)]
        assert len(opened) == 1, answers
        for error in refusals(answers):
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            assert "at most 1 open run(s) (its max_runs) and holds 1" in error.details()
        assert handle.session_host.open_run_ids == opened
        # The two slots alice could not take are the other tenants'.
        bob, carol = clients(handle, "bob", "carol")
        bob.open("bob-run", config)
        carol.open("carol-run", config)
        assert handle.session_host.open_run_ids == sorted([*opened, "bob-run", "carol-run"])


def test_on_a_server_of_one_run_opens_at_once_open_one_and_name_no_other(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    config = llama_config()
    with running_server(tmp_path / "state", model_root, tenants=tenants()) as handle:
        names = list(KEYS)
        run_ids = [f"{name}-run" for name in names]
        answers = open_together(list(zip(clients(handle, *names), run_ids, strict=True)), config)
        opened = [answer for answer in answers if isinstance(answer, str)]
        assert len(opened) == 1, answers
        for error in refusals(answers):
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            assert "another client's run is open" in error.details()
            assert not any(run_id in error.details() for run_id in run_ids), error.details()
        assert handle.session_host.open_run_ids == opened


def test_a_grpc_open_and_a_tinker_model_at_once_hold_the_tenants_max_runs(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    """Both transports open runs of one tenant: their checks are made with the open too."""
    import httpx

    keys = Tenants([Tenant("alice", "tml-alice-key", max_runs=1), Tenant("bob", "tml-bob-key")])
    options = {"tenants": keys, "max_runs": 3, "tinker_listen": "127.0.0.1:0"}
    config = llama_config(lora=LoraSettings(r=4, alpha=8))
    with running_server(tmp_path / "state", model_root, **options) as handle:
        headers = {"X-API-Key": "tml-alice-key"}
        api = f"{handle.tinker.base_url}/api/v1"
        session = httpx.post(f"{api}/create_session", json={}, headers=headers).json()
        body = {
            "session_id": session["session_id"],
            "base_model": "llama",
            "lora_config": {"rank": 4},
        }
        alice = connect(handle, token="tml-alice-key", retry=NO_RETRY)
        barrier = threading.Barrier(2)

        def create_model() -> httpx.Response:
            barrier.wait()
            return httpx.post(f"{api}/create_model", json=body, headers=headers, timeout=120)

        def open_run() -> str | grpc.RpcError:
            barrier.wait()
            try:
                return alice.open("alice-grpc", config).run_id
            except grpc.RpcError as error:
                return error

        with ThreadPoolExecutor(2) as pool:
            created, opened = pool.submit(create_model), pool.submit(open_run)
            model, grpc_answer = created.result(), opened.result()
        assert len(handle.session_host.open_run_ids) == 1, (model.text, grpc_answer)
        refusal = model.text if isinstance(grpc_answer, str) else grpc_answer.details()
        assert "at most 1 open run(s) (its max_runs)" in refusal

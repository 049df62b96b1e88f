"""Tenants on the gRPC port: another tenant's run, open or closed, is NOT_FOUND for Info, every
operation, Close and Open, and its name never appears; a tenant's ``max_runs`` holds at Open;
a run the Tinker front opened for one tenant is another's NOT_FOUND too."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import SessionClient
from trainwire.server.service.tenants import Tenant, Tenants
from trainwire.testing import tiny_token_examples

ALICE, BOB, READER = "tml-alice-key", "bob-grpc-key", "reader-key"
TENANTS = Tenants(
    [Tenant("alice", ALICE), Tenant("bob", BOB), Tenant("reader", READER, max_runs=0)]
)


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as error:
        call()
    assert error.value.code() == code, error.value
    return str(error.value)


def every_call(client: SessionClient, config) -> dict[str, object]:
    """A call of each kind on whatever run is open."""
    examples = tiny_token_examples(1, seed=1)
    return {
        "info": client.info,
        "forward": lambda: client.forward(examples),
        "forward_backward": lambda: client.forward_backward(examples, operation_key="b/fb"),
        "optim_step": lambda: client.optim_step(operation_key="b/step"),
        "sample": lambda: client.sample([1, 2, 3], max_tokens=2),
        "tokenize": lambda: client.tokenize(["hi"]),
        "detokenize": lambda: client.detokenize([[1, 2]]),
        "save_state": lambda: client.save_state("b", operation_key="b/save"),
        "load_state": lambda: client.load_state("first", operation_key="b/load"),
        "export_weights": lambda: client.export_weights("b", operation_key="b/export"),
        "close": client.close,
    }


def test_another_tenants_run_is_not_found_for_every_call_and_open(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    config = llama_config()
    with running_server(tmp_path / "state", model_root, tenants=TENANTS) as handle:
        alice = connect(handle, token=ALICE, retry=NO_RETRY)
        bob = connect(handle, token=BOB, retry=NO_RETRY)
        alice.open("alice-run", config)
        alice.forward_backward(tiny_token_examples(2, seed=0), operation_key="a/fb")
        alice.save_state("first", operation_key="a/save")
        before = alice.info()
        for name, call in every_call(bob, config).items():
            message = refused(call, grpc.StatusCode.NOT_FOUND)
            assert "alice-run" not in message, name
        message = refused(lambda: bob.open("bob-run", config), grpc.StatusCode.FAILED_PRECONDITION)
        assert "another client's run" in message and "alice-run" not in message
        refused(lambda: bob.open("alice-run", config), grpc.StatusCode.FAILED_PRECONDITION)
        assert alice.info() == before  # nothing of bob's reached alice's run
        refused(lambda: bob.close("alice-run"), grpc.StatusCode.NOT_FOUND)
        alice.close()
        # Closed, alice's run stays hers: its info, its id and its checkpoints.
        refused(bob.info, grpc.StatusCode.NOT_FOUND)
        refused(lambda: bob.open("alice-run", config), grpc.StatusCode.NOT_FOUND)
        bob.open("bob-run", config)
        assert bob.info().run_id == "bob-run"
        load = refused(
            lambda: bob.load_state("first", operation_key="b/l"), grpc.StatusCode.NOT_FOUND
        )
        assert "alice-run" not in load  # checkpoint names are the run's: alice's stay hers
        assert alice.info().state == "closed"  # her client is bound to her run, closed
        unbound = connect(handle, token=ALICE, retry=NO_RETRY)
        refused(unbound.info, grpc.StatusCode.NOT_FOUND)  # the open run is bob's
        wrong = connect(handle, token="nobody", retry=NO_RETRY)
        refused(wrong.info, grpc.StatusCode.UNAUTHENTICATED)


def test_a_tenant_without_runs_left_cannot_open_one(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    with running_server(tmp_path / "state", model_root, tenants=TENANTS) as handle:
        reader = connect(handle, token=READER, retry=NO_RETRY)
        message = refused(
            lambda: reader.open("reader-run", llama_config()), grpc.StatusCode.FAILED_PRECONDITION
        )
        assert "at most 0 open run(s) (its max_runs)" in message
        assert handle.session_host.open_run_id is None


def test_a_run_the_tinker_front_opened_for_one_tenant_is_not_found_for_another(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    options = {"tenants": TENANTS, "tinker_listen": "127.0.0.1:0"}
    with running_server(tmp_path / "state", model_root, **options) as handle:
        headers = {"X-API-Key": ALICE}
        base = f"{handle.tinker.base_url}/api/v1"
        session = httpx.post(f"{base}/create_session", json={}, headers=headers).json()
        body = {"session_id": session["session_id"], "base_model": "llama"}
        model = httpx.post(f"{base}/create_model", json=body, headers=headers, timeout=60).json()
        assert model.get("model_id"), model
        bob = connect(handle, token=BOB, retry=NO_RETRY)
        refused(bob.info, grpc.StatusCode.NOT_FOUND)
        message = refused(lambda: bob.tokenize(["hi"]), grpc.StatusCode.NOT_FOUND)
        assert model["model_id"] not in message
        alice = connect(handle, token=ALICE, retry=NO_RETRY)
        assert alice.info().run_id == handle.session_host.open_run_id  # the owner reaches it


def test_on_a_server_of_many_runs_each_tenant_trains_its_own_beside_the_others(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    from trainwire.client import LoraSettings

    config = llama_config(lora=LoraSettings(r=4, alpha=8))
    with running_server(tmp_path / "state", model_root, tenants=TENANTS, max_runs=3) as handle:
        alice = connect(handle, token=ALICE, retry=NO_RETRY)
        bob = connect(handle, token=BOB, retry=NO_RETRY)
        alice.open("alice-run", config)
        bob.open("bob-run", config)  # beside alice's: not refused on a server of many runs
        alice.forward_backward(tiny_token_examples(2, seed=0), operation_key="a/fb")
        assert [r.run_id for r in alice.runs()] == ["alice-run"]
        assert [r.run_id for r in bob.runs()] == ["bob-run"]
        bob.run_id = "alice-run"  # a client naming another tenant's run: as if none were there
        for call in every_call(bob, config).values():
            refused(call, grpc.StatusCode.NOT_FOUND)
        assert alice.info().position == 1
        refused(lambda: bob.open("alice-run", config), grpc.StatusCode.NOT_FOUND)

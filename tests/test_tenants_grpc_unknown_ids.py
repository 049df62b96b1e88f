"""Tenants on the gRPC port: a run id of another tenant's answers exactly as a run id nobody
ever opened (the same status, the same words), on Info, Close and every call that names a run,
whether that run is open or closed, on a server of one run and of many. A difference would
tell a tenant which run ids exist."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import LoraSettings, SessionClient
from trainwire.server.service.tenants import Tenant, Tenants
from trainwire.testing import tiny_token_examples

ALICE, BOB = "tml-alice-key", "bob-grpc-key"
TENANTS = Tenants([Tenant("alice", ALICE), Tenant("bob", BOB)])
ALICES_RUN, NOBODYS_RUN = "alice-run", "nobody-run"  # the same length: nothing to count


def calls_naming(client: SessionClient, run_id: str) -> dict[str, Callable[[], object]]:
    """A call of each kind that takes a run id, each naming ``run_id``."""
    examples = tiny_token_examples(1, seed=1)

    def bound(call: Callable[[], object]) -> Callable[[], object]:
        def named() -> object:
            client.run_id = run_id
            return call()

        return named

    return {
        "info": bound(client.info),
        "forward": bound(lambda: client.forward(examples)),
        "forward_backward": bound(lambda: client.forward_backward(examples, operation_key="b/fb")),
        "optim_step": bound(lambda: client.optim_step(operation_key="b/step")),
        "sample": bound(lambda: client.sample([1, 2, 3], max_tokens=2)),
        "tokenize": bound(lambda: client.tokenize(["hi"])),
        "detokenize": bound(lambda: client.detokenize([[1, 2]])),
        "save_state": bound(lambda: client.save_state("b", operation_key="b/save")),
        "load_state": bound(lambda: client.load_state("first", operation_key="b/load")),
        "load_weights": bound(lambda: client.load_weights("first", operation_key="b/lw")),
        "export_weights": bound(lambda: client.export_weights("b", operation_key="b/export")),
        "close": lambda: client.close(run_id),
    }


def answer(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details()


def assert_answered_as_nobodys(bob: SessionClient) -> None:
    """Every call naming alice's run gets what the same call naming a run id nobody opened
    gets, but for the id itself (the caller's own words, echoed back)."""
    theirs = calls_naming(bob, ALICES_RUN)
    nobodys = calls_naming(bob, NOBODYS_RUN)
    for name in theirs:
        code, details = answer(theirs[name])
        unknown_code, unknown_details = answer(nobodys[name])
        assert code == unknown_code == grpc.StatusCode.NOT_FOUND, (name, code, unknown_code)
        assert details.replace(ALICES_RUN, NOBODYS_RUN) == unknown_details, name


@pytest.mark.parametrize("max_runs", [1, 2])
def test_another_tenants_run_id_answers_as_one_nobody_opened(
    tmp_path: Path, model_root: Path, llama_config, max_runs: int
) -> None:
    config = llama_config(lora=LoraSettings(r=4, alpha=8))
    with running_server(
        tmp_path / "state", model_root, tenants=TENANTS, max_runs=max_runs
    ) as handle:
        alice = connect(handle, token=ALICE, retry=NO_RETRY)
        bob = connect(handle, token=BOB, retry=NO_RETRY)
        alice.open(ALICES_RUN, config)
        alice.forward_backward(tiny_token_examples(2, seed=0), operation_key="a/fb")
        alice.save_state("first", operation_key="a/save")
        before = alice.info()
        assert_answered_as_nobodys(bob)  # alice's run open
        assert alice.info() == before  # nothing of bob's reached it
        alice.close()
        assert_answered_as_nobodys(bob)  # and closed
        bob.run_id = ""
        bob.open("bob-run", config)
        assert_answered_as_nobodys(bob)  # bob's own run open beside
        assert alice.info().state == "closed"  # the owner still reads hers

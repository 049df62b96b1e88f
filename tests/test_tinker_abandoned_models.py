"""Abandoned models on a server of many runs: a script that ends without ``close()`` no longer
holds its ``--max-runs`` slot for ever. When every slot is taken, the model whose client has
been silent longest (past three heartbeats) gives way to a new ``create_model``; while every
client is alive the new one is refused (429, naming the limit and what frees a slot).
``trainwire runs STATE_DIR`` lists every open run with its Tinker model id, owner, age and last
operation, and ``trainwire close`` takes the model id the SDK printed.

The abandoning client is the real SDK in a process that exits without closing; the sessions'
clock is moved by hand past the lapse (a live client's heartbeat is sent as its SDK sends it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_tenants_tinker import ALICE, BOB, Front, tenant_server
from test_tinker_sessions_lapse import beat, with_clock
from tinker_loops import KEY, SENTENCES, RawFront, SdkRun, service_client, tinker_server, train_step

from trainwire import cli
from trainwire.contract.model_ids import run_id_for
from trainwire.server.process import ServerHandle
from trainwire.server.service.tenants import Tenant, Tenants
from trainwire.server.tinker.model_table import SESSION_LAPSE_S

# A real SDK script in a process of its own, and servers of many runs: with the slow tests.
pytestmark = pytest.mark.slow

# A training script that creates its model, trains nothing more and exits without close().
ABANDONING_SCRIPT = """
import os, sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
training = service.create_lora_training_client(base_model="llama", rank=4).result()
print(training.model_id, flush=True)
os._exit(0)
"""
LORA = {"base_model": "llama", "lora_config": {"rank": 4}}


def abandoned_model(handle: ServerHandle) -> str:
    """The model id of an SDK script that exited without closing its ServiceClient."""
    done = subprocess.run(
        [sys.executable, "-c", ABANDONING_SCRIPT, handle.tinker.base_url, KEY],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def sdk_run(handle: ServerHandle) -> SdkRun:
    service = service_client(handle)
    training = service.create_lora_training_client(base_model="llama", rank=4).result()
    return SdkRun(handle, service, training, training.get_tokenizer())


def listed_runs(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["runs", str(state_dir)]) == 0
    return capsys.readouterr().out


def test_the_longest_silent_model_gives_way_on_a_full_server_and_operators_see_every_run(
    tmp_path: Path, model_root: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root, max_runs=2) as handle:
        clock = with_clock(handle)
        abandoned = abandoned_model(handle)
        live = sdk_run(handle)
        train_step(live, SENTENCES[0])
        api = RawFront(handle.tinker.base_url)
        waiting = api.post("create_session", {}).json()["session_id"]

        refused = api.post("create_model", {"session_id": waiting, **LORA})
        assert refused.status_code == 429
        detail = refused.json()["detail"]
        assert "--max-runs 2" in detail and f"sent nothing for {SESSION_LAPSE_S:.0f} s" in detail
        listing = listed_runs(state_dir, capsys)
        assert abandoned in listing and live.training.model_id in listing
        assert "(OptimStep)" in listing and "none yet" in listing  # the abandoned one trained none

        clock.advance(SESSION_LAPSE_S + 1)
        assert beat(api, live.service.holder.get_session_id()) == 200  # its SDK's heartbeat
        assert beat(api, waiting) == 200
        newcomer = sdk_run(handle)  # opens at once: the abandoned model gave way
        train_step(newcomer, SENTENCES[1])
        assert api.post("get_info", {"model_id": abandoned}).status_code == 404
        train_step(live, SENTENCES[2])  # the live client's model is untouched
        assert handle.session_host.position_of(run_id_for(live.training.model_id)) == 4

        listing = listed_runs(state_dir, capsys)
        header, *rows = listing.split("\n\n")[0].splitlines()
        assert " ".join(header.split()) == "RUN TINKER MODEL OWNER OPENED LAST OPERATION POSITION"
        listed = sorted(row.split()[1] for row in rows)
        assert listed == sorted([live.training.model_id, newcomer.training.model_id])
        assert all(row.split()[2] == "default" for row in rows)

        # The operator closes a model by the id the SDK printed: closed for both ports.
        closing = newcomer.training.model_id
        (tmp_path / "key").write_text(KEY + "\n")  # both ports share the key
        closed = ["close", "--server", f"127.0.0.1:{handle.port}", "--run-id", closing]
        assert cli.main([*closed, "--token-file", str(tmp_path / "key")]) == 0
        assert f"{run_id_for(closing)}: closed at position 2" in capsys.readouterr().out
        assert api.post("get_info", {"model_id": closing}).status_code == 404
        assert closing not in listed_runs(state_dir, capsys)


def test_a_model_restored_from_before_tenants_gives_way_but_not_to_a_tenant_at_its_cap(
    tmp_path: Path, model_root: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model opened under a single key (owner ``default``), restored on a server with
    ``--tenants``: listed as ``default``'s, it gives way once silent; a tenant at its own
    ``max_runs`` is refused first (400), and nothing is closed for it."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root, max_runs=2) as handle:
        api = RawFront(handle.tinker.base_url)
        session = api.post("create_session", {}).json()["session_id"]
        old = api.post("create_model", {"session_id": session, **LORA}).json()["model_id"]
    tenants = Tenants([Tenant("alice", ALICE), Tenant("bob", BOB, max_runs=1)])
    with tenant_server(state_dir, model_root, tenants=tenants, max_runs=2) as handle:
        clock = with_clock(handle)
        bob = Front(handle, BOB)
        bob_session = bob.post("create_session", {})["session_id"]
        bob.result(bob.post("create_model", {"session_id": bob_session, **LORA}))
        rows = listed_runs(state_dir, capsys).split("\n\n")[0].splitlines()[1:]
        assert {row.split()[1]: row.split()[2] for row in rows}[old] == "default"

        clock.advance(SESSION_LAPSE_S + 1)
        heartbeat = {"session_id": bob_session}
        assert bob.send("POST", "/api/v1/session_heartbeat", json=heartbeat).status_code == 200
        second = {"session_id": bob_session, "model_seq_id": 1, **LORA}
        capped = bob.send("POST", "/api/v1/create_model", json=second)
        assert capped.status_code == 400 and "at most 1 open run" in capped.text
        assert run_id_for(old) in handle.session_host.open_run_ids  # not closed for nothing

        alice = Front(handle, ALICE)
        alice_session = alice.post("create_session", {})["session_id"]
        created = alice.post("create_model", {"session_id": alice_session, **LORA})
        alice.result(created)  # opened in the slot the restored, silent model gave up
        assert run_id_for(old) not in handle.session_host.open_run_ids
        assert run_id_for(created["model_id"]) in handle.session_host.open_run_ids

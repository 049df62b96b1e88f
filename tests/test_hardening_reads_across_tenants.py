"""What a run read stays readable to its replay as it was read, whoever owns it.

A model's ``load_state`` of a checkpoint is replayed after a restart until that model saves a
checkpoint of its own: the replay reads the checkpoint again, as its sender. So its owner may
neither unpublish it under another tenant's load (the replay would find it private) nor save
over it, nor let retention remove it (the replay would read other files, or none): each is
refused (409, as a delete is) or waits until the reader no longer needs it, and a reader
SIGKILLed and restarted ends with the bits it had. Sampler weights unpublished stop serving
another tenant's sampling client at its next sample (404, as for a path that is not there).
The real SDK drives every model; the refusals are read off the wire."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import tinker
from service_fixtures import connect, wait_for
from test_tenants_tinker import ALICE, BOB, tenant_server
from test_tinker_restart import stored_calls
from tinker import types
from tinker_loops import SENTENCES, close_quietly, service_client, supervised_datum, tinker_server

from trainwire.server.tinker.catalog import TinkerPath
from trainwire.server.tinker.model import run_id_for
from trainwire.testing import free_port

TENANTS_YAML = f"tenants:\n  - {{name: alice, key: {ALICE}}}\n  - {{name: bob, key: {BOB}}}\n"
API = "/api/v1"


class TenantServeProcess:
    """``python -m trainwire serve --tenants FILE --max-runs 2`` with the Tinker front on a
    fixed port (the SDK's ``base_url`` stays the same across a restart)."""

    def __init__(self, tmp: Path, model_root: Path, port: int, name: str) -> None:
        (tmp / "tenants.yaml").write_text(TENANTS_YAML)
        port_file, self.log = tmp / f"{name}.port", tmp / f"{name}.log"
        command = [
            sys.executable, "-m", "trainwire", "serve", "--listen", "127.0.0.1:0",
            "--state-dir", str(tmp / "state"), "--model-root", str(model_root),
            "--device", "cpu", "--tenants", str(tmp / "tenants.yaml"), "--max-runs", "2",
            "--port-file", str(port_file), "--tinker-listen", f"127.0.0.1:{port}",
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: port_file.exists() or self.process.poll() is not None, 120)
        assert self.process.poll() is None, self.log.read_text()
        self.grpc_port = int(port_file.read_text())
        self.base_url = f"http://127.0.0.1:{port}"

    def state_digest(self, model_id: str, key: str) -> str:
        """The state digest of model ``model_id``'s run, asked over gRPC with its tenant's key."""
        with connect(self.grpc_port, token=key) as client:
            client.run_id = run_id_for(model_id)
            return client.info().state_digest

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)


def send(base_url: str, key: str, method: str, route: str, **options: Any) -> httpx.Response:
    return httpx.request(
        method, f"{base_url}{API}/{route}", headers={"X-API-Key": key}, timeout=60, **options
    )


def publish(base_url: str, key: str, path: str) -> None:
    """Publish checkpoint ``path`` through the SDK's RestClient."""
    rest = tinker.RestClient(base_url=base_url, api_key=key)
    rest.publish_checkpoint_from_tinker_path(path).result(timeout=60)


def checkpoint_route(path: str) -> str:
    """The REST route of checkpoint ``path``: training_runs/<model>/checkpoints/<kind>/<name>."""
    parsed = TinkerPath.parse(path)
    return f"training_runs/{parsed.model_id}/checkpoints/{parsed.checkpoint_id}"


def step(training: Any, text: str) -> None:
    """One supervised forward_backward + optim_step, awaited."""
    datum = supervised_datum(training.get_tokenizer(), text)
    training.forward_backward([datum], "cross_entropy").result(timeout=120)
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=120)


def lora(service: tinker.ServiceClient, seed: int) -> Any:
    """A rank-4 LoRA training client on the tiny llama."""
    return service.create_lora_training_client(base_model="llama", rank=4, seed=seed).result()


def wait_for_replay(server: TenantServeProcess, tmp: Path, model_id: str, key: str) -> None:
    """Block until the restarted server has answered model ``model_id``'s last stored call
    (its replay is done)."""
    calls = [
        c for c in stored_calls(tmp / "state", "optim_step") if c.request_id.startswith(model_id)
    ]
    last = max(calls, key=lambda call: call.seq).request_id
    while True:
        answer = send(server.base_url, key, "POST", "retrieve_future", json={"request_id": last})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        if body.get("type") != "try_again":
            assert "error" not in body, body
            return


@pytest.mark.slow
def test_an_unpublish_under_another_tenants_replayed_load_is_refused_and_the_reader_ends_as_read(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Bob publishes a checkpoint; alice loads it into her open model and trains on. Bob's
    unpublish is refused (409, naming no id of alice's); after a SIGKILL alice's replayed load
    reads it as she read it and her run ends with the digest it had; once she saves a
    checkpoint of her own, the unpublish goes ahead."""
    port, servers, clients = free_port(), [], []
    try:
        servers.append(TenantServeProcess(tmp_path, model_root, port, "first"))
        url = servers[0].base_url
        bob = tinker.ServiceClient(base_url=url, api_key=BOB)
        alice = tinker.ServiceClient(base_url=url, api_key=ALICE)
        clients += [bob, alice]
        bobs = lora(bob, seed=1)
        step(bobs, SENTENCES[0])
        published = bobs.save_state("ck").result(timeout=120).path
        publish(url, BOB, published)

        alices = lora(alice, seed=2)
        alices.load_state(published).result(timeout=120)
        step(alices, SENTENCES[1])
        step(alices, SENTENCES[2])
        digest = servers[0].state_digest(alices.model_id, ALICE)

        refused = send(url, BOB, "DELETE", f"{checkpoint_route(published)}/publish")
        assert refused.status_code == 409, refused.text
        detail = refused.json()["detail"]
        assert "cannot be unpublished yet" in detail and "another tenant" in detail, detail
        assert alices.model_id not in detail

        servers[0].kill()
        servers.append(TenantServeProcess(tmp_path, model_root, port, "second"))
        wait_for_replay(servers[1], tmp_path, alices.model_id, ALICE)
        assert servers[1].state_digest(alices.model_id, ALICE) == digest

        again = send(url, BOB, "DELETE", f"{checkpoint_route(published)}/publish")
        assert again.status_code == 409, again.text
        alices.save_state("own").result(timeout=120)
        unpublished = send(url, BOB, "DELETE", f"{checkpoint_route(published)}/publish")
        assert unpublished.status_code == 204, unpublished.text
        info = send(url, ALICE, "POST", "weights_info", json={"tinker_path": published})
        assert info.status_code == 404, info.text
    finally:
        for client in clients:
            close_quietly(client)
        for server in servers:
            server.kill()


@pytest.mark.slow
def test_a_save_over_a_checkpoint_another_model_loaded_is_refused_and_the_reader_ends_as_read(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Model X saves ``ck``; model Y loads it and trains; X trains on and saves ``ck`` again:
    the save is refused through the SDK and over gRPC (409 / FAILED_PRECONDITION), and X's
    files stay what Y read, so after a SIGKILL Y's replayed load reads them and Y ends with
    the digest it had. Once Y has saved a checkpoint of its own, X saves ``ck`` again."""
    port, servers, clients = free_port(), [], []
    try:
        servers.append(TenantServeProcess(tmp_path, model_root, port, "first"))
        alice = tinker.ServiceClient(base_url=servers[0].base_url, api_key=ALICE)
        clients.append(alice)
        x, y = lora(alice, seed=1), lora(alice, seed=2)
        step(x, SENTENCES[0])
        saved = x.save_state("ck").result(timeout=120).path
        y.load_state(saved).result(timeout=120)
        step(y, SENTENCES[1])
        step(y, SENTENCES[2])
        digest = servers[0].state_digest(y.model_id, ALICE)

        step(x, SENTENCES[2])
        with pytest.raises(tinker.RequestFailedError, match="cannot be saved over yet"):
            x.save_state("ck").result(timeout=120)
        with connect(servers[0].grpc_port, token=ALICE) as client:
            client.run_id = run_id_for(x.model_id)
            with pytest.raises(grpc.RpcError, match="cannot be saved over yet") as refused:
                client.save_state("ck", operation_key="grpc-resave")
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        servers[0].kill()
        servers.append(TenantServeProcess(tmp_path, model_root, port, "second"))
        wait_for_replay(servers[1], tmp_path, y.model_id, ALICE)
        assert servers[1].state_digest(y.model_id, ALICE) == digest

        y.save_state("own").result(timeout=120)
        assert x.save_state("ck").result(timeout=120).path == saved
    finally:
        for client in clients:
            close_quietly(client)
        for server in servers:
            server.kill()


def test_retention_spares_a_checkpoint_another_models_replayed_load_reads(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Retention (keep the newest checkpoint) is a removal too: X's older ``ck``, which Y
    loaded and would load again on a replay, stays past X's next save until Y saves a
    checkpoint of its own; X's save after that removes it."""
    state_dir = tmp_path / "state"

    def folder(model_id: str, name: str) -> Path:
        return state_dir / "runs" / run_id_for(model_id) / "checkpoints" / name

    with tinker_server(state_dir, model_root, keep_checkpoints=1, max_runs=2) as handle:
        service = service_client(handle)
        x, y = lora(service, seed=1), lora(service, seed=2)
        step(x, SENTENCES[0])
        y.load_state(x.save_state("ck").result(timeout=120).path).result(timeout=120)
        step(x, SENTENCES[1])
        x.save_state("next").result(timeout=120)
        assert folder(x.model_id, "ck").is_dir()
        y.save_state("own").result(timeout=120)
        x.save_state("last").result(timeout=120)
        assert not folder(x.model_id, "ck").exists()
        assert not folder(x.model_id, "next").exists()


def test_unpublished_sampler_weights_stop_serving_another_tenants_sampling_client(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Alice's sampling client, made on bob's published sampler weights, samples; once bob
    unpublishes them, its next sample is 404 with the answer a path that is not there gets,
    and bob's own sampling client of them still samples."""
    with tenant_server(tmp_path / "state", model_root) as handle:
        url = handle.tinker.base_url
        bob = tinker.ServiceClient(base_url=url, api_key=BOB)
        alice = tinker.ServiceClient(base_url=url, api_key=ALICE)
        try:
            bobs = lora(bob, seed=1)
            step(bobs, SENTENCES[0])
            path = bobs.save_weights_for_sampler("snap").result(timeout=120).path
            publish(url, BOB, path)
            prompt = types.ModelInput.from_ints(bobs.get_tokenizer().encode("the cat"))
            params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=5)
            hers = alice.create_sampling_client(model_path=path).result(timeout=120)
            his = bob.create_sampling_client(model_path=path).result(timeout=120)
            assert hers.sample(prompt, 1, params).result(timeout=120).sequences

            unpublished = send(url, BOB, "DELETE", f"{checkpoint_route(path)}/publish")
            assert unpublished.status_code == 204, unpublished.text
            with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
                hers.sample(prompt, 1, params).result(timeout=120)
            body = {
                "sampling_session_id": hers._sampling_session_id,
                "seq_id": 99,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 2, "seed": 7},
            }
            refused = send(url, ALICE, "POST", "asample", json=body)
            missing = send(
                url,
                ALICE,
                "POST",
                "create_sampling_session",
                json={
                    "session_id": alice.holder.get_session_id(),
                    "sampling_session_seq_id": 99,
                    "model_path": path,
                },
            )
            assert refused.status_code == missing.status_code == 404, (refused.text, missing.text)
            assert refused.json() == missing.json()
            assert his.sample(prompt, 1, params).result(timeout=120).sequences
        finally:
            close_quietly(alice)
            close_quietly(bob)


@pytest.mark.slow
def test_sampler_weights_under_another_tenants_accepted_samples_are_not_deleted(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Bob's published sampler weights, sampled by alice: while her accepted samples wait for
    their turn (the one engine thread is held), bob's delete is 409 and removes nothing; once
    they ran (with sequences), the delete goes through."""
    with tenant_server(tmp_path / "state", model_root) as handle:
        url = handle.tinker.base_url
        bob = tinker.ServiceClient(base_url=url, api_key=BOB)
        alice = tinker.ServiceClient(base_url=url, api_key=ALICE)
        gate = threading.Event()
        try:
            bobs = lora(bob, seed=1)
            step(bobs, SENTENCES[0])
            path = bobs.save_weights_for_sampler("snap").result(timeout=120).path
            publish(url, BOB, path)
            hers = alice.create_sampling_client(model_path=path).result(timeout=120)
            prompt = types.ModelInput.from_ints(bobs.get_tokenizer().encode("the cat"))
            params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=5)

            # Holding the engine's one thread: every sample accepted now waits for its turn.
            holder = threading.Thread(target=handle.session_host.scheduler.run, args=(gate.wait,))
            holder.start()
            results = handle.tinker.front.intake.results
            known = len(results)
            waiting = [hers.sample(prompt, 1, params) for _ in range(3)]
            wait_for(lambda: len(results) >= known + 3, 60)  # accepted: each has its ticket
            refused = send(url, BOB, "DELETE", checkpoint_route(path))
            assert refused.status_code == 409, refused.text
            assert "accepted sample" in refused.json()["detail"], refused.text

            gate.set()
            holder.join(timeout=120)
            assert all(future.result(timeout=120).sequences for future in waiting)
            deleted = send(url, BOB, "DELETE", checkpoint_route(path))
            assert deleted.status_code in (200, 204), deleted.text
        finally:
            gate.set()
            close_quietly(alice)
            close_quietly(bob)

"""Every bound a tenant can fill is that tenant's: one tenant's calls waiting for the session
never refuse another tenant's, and a Tinker call accepted runs whatever others send."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import tinker
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_fixtures import NO_RETRY, connect, running_server, wait_for
from tinker import types
from tinker_loops import close_quietly, supervised_datum

from trainwire.client import LoraSettings, SessionClient
from trainwire.server.process import ServerHandle
from trainwire.server.service.scheduler import DEFAULT_MAX_QUEUED
from trainwire.server.service.tenants import Tenant, Tenants
from trainwire.testing import tiny_token_examples

ALICE, BOB = "tml-alice-key", "tml-bob-key"  # each calls over gRPC or the SDK alike
TENANTS = Tenants([Tenant("alice", ALICE), Tenant("bob", BOB)])
HELD_S = 600.0  # how long a held forward waits for its release at most
ANSWER_S = 60.0  # a call that should answer at once gets this long before it fails the test
FLOODERS = DEFAULT_MAX_QUEUED + 4  # bob keeps more calls in flight than his bound


@contextlib.contextmanager
def two_tenants(state_dir: Path, model_root: Path) -> Iterator[ServerHandle]:
    """A server of two runs with both ports under ``TENANTS``."""
    options = {"tenants": TENANTS, "max_runs": 2, "tinker_listen": "127.0.0.1:0"}
    with running_server(state_dir, model_root, **options) as handle:
        yield handle


def lora_client(handle: ServerHandle, key: str, run_id: str, llama_config) -> SessionClient:
    client = connect(handle, token=key, retry=NO_RETRY)
    client.open(run_id, llama_config(lora=LoraSettings(r=4, alpha=8)))
    return client


def hold_forward(handle: ServerHandle, run_id: str) -> threading.Event:
    """Make run ``run_id``'s forward wait for the returned event: the executor is held by it,
    so every call after it waits (far longer than any call a test makes meanwhile)."""
    session = handle.session_host._runs[run_id].session
    release, original = threading.Event(), session.forward

    def held(*args, **kwargs):
        release.wait(HELD_S)
        return original(*args, **kwargs)

    session.forward = held
    return release


def test_a_tenant_at_its_bound_of_waiting_calls_never_refuses_anothers(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    """Bob holds all his waiting calls (his first is stuck on the device): his next is
    RESOURCE_EXHAUSTED, while alice's calls wait (admitted: none refused) and all of her bound
    fits too, with health still answering at once (the port has threads for each tenant's
    bound); once bob's call ends, every admitted call completes."""
    with two_tenants(tmp_path / "state", model_root) as handle:
        bob = lora_client(handle, BOB, "bob-run", llama_config)
        alice = lora_client(handle, ALICE, "alice-run", llama_config)
        examples = tiny_token_examples(2, seed=1)
        host = handle.session_host
        release = hold_forward(handle, "bob-run")
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(ThreadPoolExecutor(2 * DEFAULT_MAX_QUEUED))
            stack.callback(release.set)
            bobs = [pool.submit(bob.forward, examples) for _ in range(DEFAULT_MAX_QUEUED)]
            wait_for(lambda: host.scheduler.waiting == DEFAULT_MAX_QUEUED, ANSWER_S)
            with pytest.raises(grpc.RpcError) as refused:
                bob.forward(examples)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            alices = [pool.submit(alice.forward, examples) for _ in range(DEFAULT_MAX_QUEUED)]
            wait_for(lambda: host.scheduler.waiting == 2 * DEFAULT_MAX_QUEUED, ANSWER_S)
            assert not any(f.done() for f in alices)  # admitted, waiting: none refused
            health = health_pb2_grpc.HealthStub(alice._channel)
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert not release.is_set()  # answered while every call waits
            release.set()
            answers = [f.result(timeout=HELD_S) for f in alices]
            assert answers == [alice.forward(examples)] * DEFAULT_MAX_QUEUED  # as alone
            assert all(f.result(timeout=HELD_S) for f in bobs)
        assert f"the limit is {DEFAULT_MAX_QUEUED} per key" in refused.value.details()
        alice.close_channel()
        bob.close_channel()


def test_one_tenants_grpc_flood_never_fails_another_tenants_accepted_sdk_calls(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    """Bob keeps more gRPC forwards in flight than his bound (some are refused: his bound is
    full) while alice trains through the SDK: every one of her accepted calls completes, none
    answered RESOURCE_EXHAUSTED through its future."""
    with two_tenants(tmp_path / "state", model_root) as handle:
        bob = lora_client(handle, BOB, "bob-run", llama_config)
        service = tinker.ServiceClient(base_url=handle.tinker.base_url, api_key=ALICE)
        stop, refusals = threading.Event(), []
        examples = tiny_token_examples(1, seed=2)

        def flood() -> None:
            while not stop.is_set():
                try:
                    bob.forward(examples)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                    refusals.append(error)

        flooders = [threading.Thread(target=flood) for _ in range(FLOODERS)]
        try:
            training = service.create_lora_training_client(base_model="llama", rank=4).result()
            tokenizer = training.get_tokenizer()
            data = [supervised_datum(tokenizer, "the cat sat on the mat")]
            for thread in flooders:
                thread.start()
            wait_for(lambda: refusals, ANSWER_S)  # bob's bound is full
            futures = []
            for _ in range(4):
                futures.append(training.forward_backward(data, "cross_entropy"))
                futures.append(training.optim_step(types.AdamParams(learning_rate=1e-2)))
            results = [future.result(timeout=HELD_S) for future in futures]
            assert all(result.metrics for result in results)
        finally:
            stop.set()
            for thread in flooders:
                thread.join(timeout=HELD_S)
            close_quietly(service)
        assert not any(thread.is_alive() for thread in flooders)
        bob.close_channel()

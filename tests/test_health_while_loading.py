"""Health is NOT_SERVING while the server loads a model (an Open) and while it restores a run
left open (a restart), and SERVING once it is done: asserted inside each window, which the test
holds open by holding the real session's construction, not waited through."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_fixtures import TEXTS, connect, running_server, wait_for

from trainwire.server.engine.session import TrainingSession

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HeldLoads:
    """A session factory that builds the real ``TrainingSession`` once ``release`` is set;
    ``loading`` is set as a build starts."""

    def __init__(self) -> None:
        self.loading, self.release = threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> TrainingSession:
        self.loading.set()
        assert self.release.wait(120), "the test never released the load"
        return TrainingSession(*args, **kwargs)


def health(port: int) -> int:
    """The server's health, asked on a channel of its own (a client would wait for SERVING)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status


def test_health_is_not_serving_while_an_open_loads_the_model(tmp_path, model_root, llama_config):
    held = HeldLoads()
    with running_server(tmp_path / "state", model_root, session_factory=held) as handle:
        client = connect(handle)
        assert health(handle.port) == SERVING
        with ThreadPoolExecutor(1) as pool:
            opening = pool.submit(client.open, "run", llama_config())
            assert held.loading.wait(60)
            assert health(handle.port) == NOT_SERVING  # inside the load
            held.release.set()
            opening.result(timeout=120)
        assert health(handle.port) == SERVING
        client.close_channel()


def test_health_is_not_serving_while_a_restart_restores_the_open_run(
    tmp_path, model_root, llama_config
):
    state_dir = tmp_path / "state"
    with running_server(state_dir, model_root) as handle, connect(handle) as client:
        client.open("run", llama_config())
        client.forward_backward(TEXTS[:2], operation_key="fb")
    held = HeldLoads()
    with running_server(state_dir, model_root, session_factory=held) as handle:
        assert held.loading.wait(60)
        assert health(handle.port) == NOT_SERVING  # inside the restore
        held.release.set()
        wait_for(lambda: health(handle.port) == SERVING, 120)
        with connect(handle) as client:
            assert client.info().state == "open"  # restored (to its latest checkpoint: none)

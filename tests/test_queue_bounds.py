"""Queued work is bounded, and health and Info answer at once whatever is queued."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_fixtures import NO_RETRY, TEXTS, connect, running_server

from trainwire.server.service.scheduler import DEFAULT_MAX_QUEUED

HELD_S = 600.0  # how long a held operation waits for its release at most
ANSWER_S = 60.0  # a call that should answer at once gets this long before it fails the test


def hold_forward_backward(session) -> threading.Event:
    """Make ``session``'s forward_backward wait for the returned event (a slow operation). It
    waits far longer than any call a test makes meanwhile: whatever answers before the release
    did not queue behind it, however slow the machine."""
    release, original = threading.Event(), session.forward_backward

    def slow(examples, **loss):
        release.wait(HELD_S)
        return original(examples, **loss)

    session.forward_backward = slow
    return release


def test_a_slow_operation_with_a_full_queue_leaves_health_and_info_answering(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("busy", llama_config())
        client.forward_backward(TEXTS[:2], operation_key="done")
        settled = client.info()
        release = hold_forward_backward(handle.session_host.session)
        errors: list[BaseException] = []

        def send(index: int) -> None:
            try:
                client.forward_backward(TEXTS[2:4], operation_key=f"queued/{index}")
            except grpc.RpcError as error:
                errors.append(error)

        senders = [threading.Thread(target=send, args=(i,)) for i in range(DEFAULT_MAX_QUEUED)]
        for thread in senders:
            thread.start()
        deadline = time.monotonic() + 30
        while handle.session_host.scheduler.waiting < DEFAULT_MAX_QUEUED:
            assert time.monotonic() < deadline, "the calls never queued"
            time.sleep(0.01)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                client.forward_backward(TEXTS[4:6], operation_key="one too many")
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "wait for their results" in refused.value.details()

            health = health_pb2_grpc.HealthStub(client._channel)
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
            info = client.info()
            assert not release.is_set()  # answered while the operation is held: not behind it
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # As of the last finished operation: the one before the slow one.
            assert (info.position, info.last_operation_key) == (1, "done")
            assert info.state_digest in ("", settled.state_digest)
        finally:
            release.set()
            for thread in senders:
                thread.join(timeout=120)
        assert errors == []
        assert client.info().position == 1 + DEFAULT_MAX_QUEUED
        client.close_channel()


@pytest.mark.slow  # the 24 held calls wait for their predecessors until nothing ran for 2 s
def test_calls_held_for_their_position_count_against_the_bound_and_health_answers(
    tmp_path, model_root, llama_config
):
    """Issue 21.8: keyed calls whose expected position is far ahead wait in position order; they
    hold server threads as queued calls do, so they count against the same bound."""
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("ahead", llama_config())
        codes: list[grpc.StatusCode] = []

        def send(index: int) -> None:
            try:
                client.forward_backward(
                    TEXTS[:2], operation_key=f"ahead/{index}", expected_position=1000 + index
                )
            except grpc.RpcError as error:
                codes.append(error.code())

        senders = [threading.Thread(target=send, args=(i,)) for i in range(DEFAULT_MAX_QUEUED + 6)]
        for thread in senders:
            thread.start()
        deadline = time.monotonic() + 30
        while len(codes) < 6:  # the ones past the bound are refused at once
            assert time.monotonic() < deadline, f"refused so far: {codes}"
            time.sleep(0.01)
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6
        assert handle.session_host.scheduler.waiting == DEFAULT_MAX_QUEUED
        health = health_pb2_grpc.HealthStub(client._channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
        assert client.info().position == 0
        # Answered while every held call still waits (the order lets them go only after 2 s idle,
        # and then refuses it): neither queued behind them.
        assert codes.count(grpc.StatusCode.FAILED_PRECONDITION) == 0
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for thread in senders:
            thread.join(timeout=120)  # let go once nothing runs; refused then
        assert codes.count(grpc.StatusCode.FAILED_PRECONDITION) == DEFAULT_MAX_QUEUED
        client.close_channel()


def test_info_answers_at_once_while_the_first_operation_runs(tmp_path, model_root, llama_config):
    """Issue 21.8: before any operation finished there was no snapshot to answer with, so Info
    calls queued behind the first operation without bound."""
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("first", llama_config())
        release = hold_forward_backward(handle.session_host.session)
        first = threading.Thread(
            target=lambda: client.forward_backward(TEXTS[:2], operation_key="first")
        )
        first.start()
        try:
            deadline = time.monotonic() + 30
            while not handle.session_host.scheduler.busy:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            infos = [client.info() for _ in range(40)]
            assert not release.is_set()  # all answered while the first operation is held
            assert {(i.position, i.state) for i in infos} == {(0, "open")}
        finally:
            release.set()
            first.join(timeout=120)
        client.close_channel()

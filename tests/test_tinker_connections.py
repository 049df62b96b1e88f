"""Strangers cannot starve the owner by holding connections open (issue 21.7): the Tinker
listener bounds its connections and the time to send a request's headers, the gRPC listener the
time to finish its handshake, and the owner's calls go on throughout."""

from __future__ import annotations

import socket

import httpx
from service_fixtures import TEXTS, connect, wait_for
from tinker_loops import KEY, tinker_server

from trainwire.server.grpc import listener as grpc_listener
from trainwire.server.tinker import connections

HALF_SENT = b"POST /api/v1/create_session HTTP/1.1\r\nHost: squatter\r\n"


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server closed ``sock``: what it sent is read, then the end of the stream."""
    sock.setblocking(False)
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    return True


def squat(port: int, count: int, payload: bytes) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        if payload:
            sock.sendall(payload)
        sockets.append(sock)
    return sockets


def test_half_sent_requests_are_bounded_and_cut_off_and_the_owner_goes_on(
    tmp_path, model_root, tiny_llama, llama_config, monkeypatch
) -> None:
    monkeypatch.setattr(connections, "MAX_CONNECTIONS", 20)
    # First the bound alone: a deadline far away, so only the bound can close a connection.
    monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 600.0)
    with tinker_server(tmp_path / "state", model_root) as handle:
        port = int(handle.tinker.base_url.rsplit(":", 1)[1])
        held = handle.tinker._server.server_state.connections  # what the listener holds open
        sockets = squat(port, 40, HALF_SENT)
        try:
            wait_for(lambda: sum(closed_by_peer(sock) for sock in sockets) >= 20, 30)
            wait_for(lambda: len(held) == 20, 30)
            assert sum(closed_by_peer(sock) for sock in sockets) == 20  # exactly the excess
            with connect(handle, token=KEY) as owner:  # the gRPC side is untouched
                owner.open("run", llama_config(), max_steps=4)
                owner.forward_backward(TEXTS[:3], operation_key="fb")
                assert owner.save_state("c", operation_key="save").position == 2
        finally:
            for sock in sockets:
                sock.close()

        # Then the deadline: within the bound, half-sent requests are cut off once it passes.
        wait_for(lambda: len(held) == 0, 30)
        monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 1.0)
        sockets = squat(port, 5, HALF_SENT)
        try:
            # Well inside the bound: only the deadline can close them.
            wait_for(lambda: all(closed_by_peer(sock) for sock in sockets), 30)
            url = f"{handle.tinker.base_url}/api/v1/healthz"
            assert httpx.get(url, headers={"X-API-Key": KEY}).status_code == 200
        finally:
            for sock in sockets:
                sock.close()


def test_a_grpc_connection_that_never_finishes_its_handshake_is_cut_off(
    tmp_path, model_root, monkeypatch
) -> None:
    monkeypatch.setattr(grpc_listener, "HANDSHAKE_TIMEOUT_S", 1.0)
    with tinker_server(tmp_path / "state", model_root) as handle:
        sockets = squat(handle.port, 10, b"PRI * HTTP/2.0\r\n")  # half a preface
        try:
            wait_for(lambda: all(closed_by_peer(sock) for sock in sockets), 10)
        finally:
            for sock in sockets:
                sock.close()

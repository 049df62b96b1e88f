"""Connections before a key is shown are a stranger's budget of their own: a keyless peer that
keeps far more connections open than the front takes, each asking again every 2 s, never keeps
a tenant from connecting."""

from __future__ import annotations

import socket
import statistics
import threading
import time

import httpx
import pytest
from test_tinker_connections import closed_by_peer
from tinker_loops import KEY, tinker_server

from trainwire.server.tinker.connections import MAX_CONNECTIONS, MAX_UNKEYED_CONNECTIONS

# A bounded flood of 300 connections: with the slow tests.
pytestmark = pytest.mark.slow

KEYLESS_REQUEST = b"GET /api/v1/healthz HTTP/1.1\r\nHost: stranger\r\n\r\n"
FLOOD_CONNECTIONS = MAX_CONNECTIONS + 44  # more than the front takes in all
FLOOD_PERIOD_S = 2.0  # each connection asks again this often
FLOOD_LIMIT_S = 180.0  # the flood stops by itself past this, whatever the test does
CONNECTS = 20  # a tenant's new connections measured under the flood
CONNECT_LIMIT_S = 30.0  # one that takes longer never got in


class KeylessFlood(threading.Thread):
    """``count`` connections to the front on loopback, each sending a keyless request every
    ``FLOOD_PERIOD_S`` and opened again whenever the front closes it; until ``stop`` or
    ``FLOOD_LIMIT_S``."""

    def __init__(self, port: int, count: int) -> None:
        super().__init__(name="keyless-flood", daemon=True)
        self.port, self.count = port, count
        self.stop = threading.Event()
        self.rounds = 0

    def run(self) -> None:
        deadline = time.monotonic() + FLOOD_LIMIT_S
        sockets: list[socket.socket | None] = [None] * self.count
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                for index, sock in enumerate(sockets):
                    sockets[index] = self._asking(sock)
                self.rounds += 1
                self.stop.wait(FLOOD_PERIOD_S)
        finally:
            for sock in sockets:
                if sock is not None:
                    sock.close()

    def _asking(self, sock: socket.socket | None) -> socket.socket | None:
        """``sock`` (or a new connection where the front closed it) after sending a request."""
        try:
            if sock is not None and closed_by_peer(sock):
                sock.close()
                sock = None
            if sock is None:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                sock.setblocking(False)
            sock.sendall(KEYLESS_REQUEST)
            return sock
        except OSError:
            if sock is not None:
                sock.close()
            return None


def idle_without_a_key(connection) -> bool:
    """An open connection of the front, no request under way, that never showed a key."""
    cycle = connection.cycle
    idle = cycle is None or cycle.response_complete
    closing = connection.transport.is_closing()
    return idle and not getattr(connection, "keyed", False) and not closing


def time_to_connect(url: str) -> float:
    """Seconds until a new connection with the tenant's key is answered (tries again when the
    front closes it); ``CONNECT_LIMIT_S`` and more: it never got in."""
    started = time.monotonic()
    while time.monotonic() - started < CONNECT_LIMIT_S:
        try:
            answer = httpx.get(url, headers={"X-API-Key": KEY}, timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        assert answer.status_code == 200, answer.text
        return time.monotonic() - started
    return CONNECT_LIMIT_S


def test_a_keyless_flood_of_connections_never_keeps_a_tenant_from_connecting(
    tmp_path, model_root, tiny_llama
) -> None:
    with tinker_server(tmp_path / "state", model_root) as handle:
        port = int(handle.tinker.base_url.rsplit(":", 1)[1])
        held = handle.tinker._server.server_state.connections
        flood = KeylessFlood(port, FLOOD_CONNECTIONS)
        flood.start()
        try:
            while flood.rounds < 2 and flood.is_alive():  # every connection has asked, twice
                time.sleep(0.05)
            url = f"{handle.tinker.base_url}/api/v1/healthz"
            strangers, times = [], []
            for _ in range(CONNECTS):
                times.append(time_to_connect(url))
                strangers.append(sum(idle_without_a_key(c) for c in list(held)))
                if times[-1] >= CONNECT_LIMIT_S:
                    break  # locked out: no need to wait for the others
                time.sleep(FLOOD_PERIOD_S / 4)  # spread over the flood's rounds
            flooding = flood.is_alive()
        finally:
            flood.stop.set()
            flood.join(timeout=60)
        assert flooding  # it flooded throughout
        print(
            f"keyed connect under a flood of {FLOOD_CONNECTIONS} keyless connections: "
            f"median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms; "
            f"idle connections without a key: at most {max(strangers)}"
        )
        assert max(times) < CONNECT_LIMIT_S, times
        assert max(strangers) <= MAX_UNKEYED_CONNECTIONS, strangers
        assert not flood.is_alive()

"""The Tinker listener's connections, bounded: how many may be open, how many of them before a
key is shown, and how long one may take to send a request's headers.

uvicorn keeps a connection that never finishes its request open for as long as the peer likes,
and takes any number of them: a review held 1,100 half-sent requests open, the process ran out
of file descriptors, and the owner's SaveState failed ("Too many open files"). Here a connection
past ``MAX_CONNECTIONS`` is closed as it arrives, before anything is read, and one that has not
sent a whole request's headers ``HEADER_TIMEOUT_S`` after it opened (or after its last response)
is closed. A request whose headers arrived is left alone: a held poll (20 s) or a large body
upload is bounded elsewhere (``limits``, the poll's hold).

On a front with keys, a connection that has not shown a tenant's key is a stranger's until it
does, and strangers share a budget of their own (``MAX_UNKEYED_CONNECTIONS``): a review held all
256 connections with one 401 request each every 2 s, and no tenant could connect. A new
connection past that budget closes the oldest idle one of them (a connection in the middle of a
request is left to finish it), so a tenant's new connection always gets in and shows its key in
its first request; a request refused 401 closes its connection (``auth.RequireKey``).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from trainwire.server.service.tenants import Tenants

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # the SDK's clients open a handful each
# Connections that have not shown a key: a stranger's budget, far below the bound of all, so the
# rest is always there for tenants (a client shows its key in the first request's headers).
MAX_UNKEYED_CONNECTIONS = 32
HEADER_TIMEOUT_S = 10.0  # generous for any client on a real network; short for a squatter
API_KEY_HEADER = b"x-api-key"


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection bound, a budget for connections without a key,
    and a deadline for each request's head. ``tenants``: the front's keys (None: a front
    without keys, where every connection is as good as keyed)."""

    tenants: Tenants | None = None
    keyed = False  # a request of this connection showed a tenant's key
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.keyed = self.tenants is None
        self.opened_at = self.loop.time()
        if len(self.connections) > MAX_CONNECTIONS:
            logger.warning("Tinker front: %d connections open; one more refused", MAX_CONNECTIONS)
            transport.abort()
            return
        self._keep_strangers_within_budget()
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.keyed and self.cycle is not None:  # a request's head arrived
            supplied = dict(self.headers).get(API_KEY_HEADER)
            self.keyed = self.tenants is not None and self.tenants.by_key(supplied) is not None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # a kept-alive connection's next request gets as long

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """No request under way (none yet, or the last one answered)."""
        return self.cycle is None or self.cycle.response_complete

    def _keep_strangers_within_budget(self) -> None:
        """Past ``MAX_UNKEYED_CONNECTIONS`` open connections without a key (this new one among
        them), close the oldest idle one of the others: so at most that many wait idle without
        a key (a request under way, answered 401 at once, closes its connection)."""
        strangers = [c for c in self.connections if is_stranger(c)]
        if len(strangers) <= MAX_UNKEYED_CONNECTIONS:
            return
        idle = [c for c in strangers if c is not self and c.idle]
        if idle:
            oldest = min(idle, key=lambda c: c.opened_at)
            logger.info("Tinker front: %d connections without a key: oldest closed", len(strangers))
            oldest.transport.abort()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_overdue)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_overdue(self) -> None:
        """Close the connection unless a request is under way (its headers all arrived)."""
        self._header_deadline = None
        if self.idle:
            self.transport.close()


def is_stranger(connection: H11Protocol) -> bool:
    """Whether ``connection`` is open and has not shown a key (one closing counts no more)."""
    return not getattr(connection, "keyed", True) and not connection.transport.is_closing()


def bounded_protocol(tenants: Tenants | None) -> type[BoundedH11Protocol]:
    """The protocol class of a front whose keys are ``tenants`` (uvicorn builds one protocol
    object per connection from it)."""
    return type(BoundedH11Protocol.__name__, (BoundedH11Protocol,), {"tenants": tenants})

"""The Tinker listener's connections, bounded: how many may be open, and how long one may take
to send a request's headers.

uvicorn keeps a connection that never finishes its request open for as long as the peer likes,
and takes any number of them: a review held 1,100 half-sent requests open, the process ran out
of file descriptors, and the owner's SaveState failed ("Too many open files"). Here a connection
past ``MAX_CONNECTIONS`` is closed as it arrives, before anything is read, and one that has not
sent a whole request's headers ``HEADER_TIMEOUT_S`` after it opened (or after its last response)
is closed. A request whose headers arrived is left alone: a held poll (20 s) or a large body
upload is bounded elsewhere (``limits``, the poll's hold).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # the SDK's clients open a handful each
HEADER_TIMEOUT_S = 10.0  # generous for any client on a real network; short for a squatter


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection bound and a deadline for each request's head."""

    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            logger.warning("Tinker front: %d connections open; one more refused", MAX_CONNECTIONS)
            transport.abort()
            return
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # a kept-alive connection's next request gets as long

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

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
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

"""A listen address (``HOST:PORT``), read the same way for the gRPC port and the Tinker front.

Read once, before anything binds: a port past 65535 is not refused by the resolvers underneath
(they wrap it, so ``--listen 127.0.0.1:99999`` served on port 34463, silently). Nothing here
imports torch or gRPC: ``trainwire serve`` refuses a bad address in one line at once.
"""

from __future__ import annotations

LAST_PORT = 65535


def split_listen(listen: str, option: str) -> tuple[str, int]:
    """``listen``'s host (as given: an IPv6 one keeps its brackets) and port; ValueError naming
    ``option`` for anything else than ``HOST:PORT`` with a port from 0 (a free one) to 65535."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{option} takes HOST:PORT (port 0 picks a free one), got {listen!r}")
    number = int(port)
    if number > LAST_PORT:
        raise ValueError(f"{option} {listen}: ports go from 0 (a free one) to {LAST_PORT}")
    return host, number

"""Which keys guard each port of a server: one map for both, never a keyed port beside an open one.

The gRPC port and the Tinker front reach the same runs, so a key on one port and none on the
other keys nothing: whoever the key keeps out walks in through the open port (a review listed,
read, sampled and closed every tenant's run over a keyless gRPC port beside a Tinker front keyed
by a tenants map). A server therefore has keys on every port it listens on, or on none, and then
serves its Tinker front on loopback only. ``--tenants FILE`` keys both ports with one map;
``--token-file`` and ``--tinker-token-file`` key one port each (a key, or the same map).

Nothing here imports torch or gRPC: ``trainwire serve`` refuses a bad combination in one line
before it loads anything.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from trainwire.server.service.tenants import Tenants

Keys = str | Tenants | None


@dataclass(frozen=True)
class PortKeys:
    """The keys of the gRPC port and of the Tinker front (None: that port takes any caller)."""

    grpc: Keys
    tinker: Keys


def port_keys(
    tinker_listen: str | None, tenants: Tenants | None, token: Keys, tinker_token: Keys
) -> PortKeys:
    """Each port's keys from the options given (``tenants`` for both, or each its own),
    ValueError (one line) for a keyed port beside an open one, or a key for a front that does
    not listen while the gRPC port is open."""
    if tenants is not None:
        if token is not None or tinker_token is not None:
            raise ValueError(
                "--tenants gives the keys of both ports: leave out --token-file and "
                "--tinker-token-file (or put the tenants map in those files instead)"
            )
        return PortKeys(tenants, tenants)
    if tinker_listen is None:
        if tinker_token and not token:
            raise ValueError(
                "--tinker-token-file without --tinker-listen keys no port, and the gRPC port "
                "(--listen) takes calls without a key: give the gRPC port its key with "
                "--token-file (or --tenants FILE), or add --tinker-listen with --token-file"
            )
        return PortKeys(token, tinker_token)
    if token and not tinker_token:
        raise ValueError(
            "--tinker-listen needs --tinker-token-file when the gRPC port needs --token-file: "
            "the Tinker front trains the same runs, so without a key of its own it would let "
            "anyone in. Give the front a key (a file holding a 'tml-' key; it may differ from "
            "the gRPC token), or key both ports with one map: --tenants FILE"
        )
    if tinker_token and not token:
        raise ValueError(
            "--tinker-token-file keys the Tinker front, but the gRPC port (--listen) has no "
            "key: any local process would list, read, sample and close every run over gRPC. "
            "Give the gRPC port a key too with --token-file (it may be the same file), or key "
            "both ports with one map: --tenants FILE"
        )
    if not tinker_token and not is_loopback(tinker_listen):
        raise ValueError(
            f"--tinker-listen {tinker_listen} reaches beyond loopback without a key: give "
            "both ports keys (--tenants FILE, or --token-file and --tinker-token-file), or "
            "listen on 127.0.0.1"
        )
    return PortKeys(token, tinker_token)


def is_loopback(listen: str) -> bool:
    """``HOST:PORT`` names a loopback host (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or a wildcard: reachable from elsewhere

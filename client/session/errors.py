"""What a failed ``SessionClient`` call raises: trainwire's own exceptions, one line each.

They subclass ``grpc.RpcError`` with the methods a gRPC call error has (``code()``,
``details()``, ``trailing_metadata()``), so code written against grpc keeps working, while the
message is the reason and the status in one line instead of grpc's multi-line debug dump, and
no grpc traceback is chained to it. A server that was never reached is told apart
(``ServerUnreachable``): an address nobody serves fails at once with what was tried and what to
check, where a server that answered before is worth waiting for (the controller's outage
handling).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

# gRPC's own target syntaxes (https://grpc.github.io/grpc/core/md_doc_naming.html): passed as is.
GRPC_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock")
URL_SCHEMES = ("http", "https", "grpc", "grpcs")
PROBE_TIMEOUT_S = 3.0
# How long a first call waits for a port nobody listens on yet to open: a server started a moment
# ago binds its port a few seconds in (``trainwire serve ... &`` pasted with the next command).
STARTUP_GRACE_S = 10.0


class SessionError(grpc.RpcError):
    """A call the server (or the connection to it) refused: ``.code()`` is the status,
    ``.details()`` the reason, ``str()`` both in one line."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        *,
        trailing_metadata: Sequence[tuple[str, Any]] = (),
    ) -> None:
        super().__init__(f"{details} ({code.name})")
        self._code = code
        self._details = details
        self._trailing = tuple(trailing_metadata)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SessionError:
        """The one-line form of a grpc call error (one already ours is returned as is)."""
        if isinstance(error, SessionError):
            return error
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else None) or str(error)
        trailing = getattr(error, "trailing_metadata", lambda: None)() or ()
        return cls(code, _one_line(details), trailing_metadata=trailing)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing

    def initial_metadata(self) -> tuple[tuple[str, Any], ...]:
        return ()


class ServerUnreachable(SessionError):
    """No trainwire server ever answered at the target: nothing listens there, the name does
    not resolve, or what listens does not speak gRPC. UNAVAILABLE, raised within seconds."""

    def __init__(self, target: str, reason: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"no trainwire server at {target}: {reason}; check the address (HOST:PORT, as "
            "trainwire serve's --listen says) and that the server is running",
        )
        self.target = target


class InvalidTarget(ValueError):
    """An address a gRPC client cannot mean: a URL, or a host without a port."""


def check_target(target: str) -> None:
    """Refuse an address that cannot be a trainwire server's ``HOST:PORT``, saying why."""
    scheme, sep, rest = target.partition("://")
    if sep and scheme.lower() in URL_SCHEMES:
        hint = f" ({rest.rstrip('/')})" if rest else ""
        raise InvalidTarget(
            f"{target!r} is a URL: a trainwire server's gRPC address is HOST:PORT{hint}; "
            "http:// URLs are for the Tinker SDK (serve's --tinker-listen port)"
        )
    if target.split(":", 1)[0].lower() in GRPC_SCHEMES:
        return
    host, port = split_host_port(target)
    if not host:
        raise InvalidTarget(f"{target!r}: no host; give HOST:PORT (e.g. 127.0.0.1:50051)")
    if port is None:
        raise InvalidTarget(
            f"{target!r} has no port: give HOST:PORT, the address trainwire serve's --listen "
            f"names (e.g. {host}:50051)"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidTarget(f"{target!r}: port {port!r} is not a port number (1-65535)")


def split_host_port(target: str) -> tuple[str, str | None]:
    """``(host, port)`` of ``HOST:PORT`` or ``[IPV6]:PORT``; port None when there is none."""
    if target.startswith("["):
        host, _, after = target[1:].partition("]")
        return host, after[1:] if after.startswith(":") else None
    if target.count(":") > 1:  # a bare IPv6 address: gRPC needs brackets to add a port
        return target, None
    host, sep, port = target.partition(":")
    return host, port if sep else None


@dataclass(frozen=True)
class Unreachable:
    """Why a target cannot be a gRPC server; ``refused``: nothing listens there (yet)."""

    reason: str
    refused: bool = False


def unreachable(target: str) -> Unreachable | None:
    """Why ``target`` cannot be a gRPC server, from a plain TCP connection; None when something
    accepts connections there (then a gRPC call decides)."""
    host, port = split_host_port(target)
    if port is None or not port.isdigit():
        return None  # a gRPC-syntax target (unix:, dns:///...): gRPC's own failure says
    try:
        addresses = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        return Unreachable(f"the host name {host!r} does not resolve ({error.strerror})")
    found = Unreachable("nothing answered")
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.settimeout(PROBE_TIMEOUT_S)
            try:
                probe.connect(address)
            except ConnectionRefusedError:
                found = Unreachable(f"connection refused: nothing listens on port {port}", True)
            except TimeoutError:
                found = Unreachable(f"no answer within {PROBE_TIMEOUT_S:.0f}s (a firewall?)")
            except OSError as error:
                found = Unreachable(
                    error.strerror or errno.errorcode.get(error.errno or 0, str(error))
                )
            else:
                return None
    return found


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "no details"

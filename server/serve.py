"""The gRPC server: ``serve(...)`` for Python callers, ``trainwire serve`` for the command line.

One process, one session host, one executor: the servicer's calls queue on the host's lock. Around
it: standard health (NOT_SERVING while loading or restoring) and reflection, a bearer-token check
on every call but health, TLS or mutual TLS, a cap on request size (a bigger request is
RESOURCE_EXHAUSTED and the server keeps serving), and a graceful stop on SIGTERM: the operation
in flight finishes and commits, new ones are UNAVAILABLE, the process exits 0.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import sys
import threading
import types
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from trainwire.client.files import write_text_atomic
from trainwire.client.overrides import parse_config_overrides
from trainwire.server.host import SessionHost
from trainwire.server.servicer import TrainingSessionServicer, add_to_server
from trainwire.v1 import session_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = session_pb2.DESCRIPTOR.services_by_name["TrainingSessionService"].full_name
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_WORKERS = 32
DEFAULT_STOP_GRACE_S = 60.0

Pem = bytes | str | Path  # PEM bytes, or a path to a PEM file


def _pem(value: Pem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call but health without ``authorization: Bearer <token>`` (constant time)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token is empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        supplied = str(metadata.get("authorization", "")).encode()
        if hmac.compare_digest(supplied, self._expected):
            return handler
        message = (
            "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'"
            if supplied
            else "missing bearer token: send metadata 'authorization: Bearer <token>'"
        )
        return _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, message)


def _refusing_handler(handler, code: grpc.StatusCode, message: str):
    """A handler of ``handler``'s kind that fails every call with ``code``."""

    def refuse(request_or_iterator, context):
        context.abort(code, message)

    kinds = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for kind, make in kinds.items():
        if getattr(handler, kind) is not None:
            return make(
                refuse,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


class ServerHandle:
    """A running server: ``port``, ``host`` (the session host), ``stop()`` and ``wait()``."""

    def __init__(
        self, server: grpc.Server, host: SessionHost, health_servicer, address: str, port: int
    ) -> None:
        self.server = server
        self.host = host
        self.health = health_servicer
        self.address = address
        self.port = port
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    @property
    def target(self) -> str:
        """A loopback-friendly ``HOST:PORT`` a client can dial."""
        return self.address

    def stop(self, grace: float | None = None) -> None:
        """Stop gracefully: refuse new operations, let the one in flight finish and commit.

        Args:
            grace: seconds to wait for the operation in flight; None waits until it finishes.
        """
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self.host.begin_shutdown()
            self.health.enter_graceful_shutdown()
            if not self.host.wait_idle(grace):
                logger.warning("the operation in flight did not finish within %.1fs", grace)
            self.server.stop(grace=1.0 if grace is None else grace).wait()
            self.host.release()
            self._stopped.set()
            logger.info("server on port %d stopped", self.port)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server is stopped; False if ``timeout`` passed first."""
        return self._stopped.wait(timeout)


def serve(
    listen: str,
    state_dir: str | Path,
    model_root: str | Path | None = None,
    device: str | None = None,
    token: str | None = None,
    *,
    tls_cert: Pem | None = None,
    tls_key: Pem | None = None,
    tls_client_ca: Pem | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_workers: int = DEFAULT_MAX_WORKERS,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> ServerHandle:
    """Start a server on ``listen`` (``HOST:PORT``; port 0 picks a free one) and return its handle.

    It answers at once: a session left open in ``state_dir`` is restored in the background
    (health NOT_SERVING meanwhile). ``tls_*`` take PEM bytes or file paths; ``tls_client_ca``
    requires client certificates signed by it. ``interceptors`` run after the token check.
    """
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("TLS needs both a certificate and its key")
    if tls_client_ca is not None and tls_cert is None:
        raise ValueError("client certificate checks (tls_client_ca) need TLS: give tls_cert/key")
    if max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be at least 1024, got {max_message_bytes}")
    health_servicer = health.HealthServicer()

    def on_serving(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )  # fmt: skip
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, status)

    chain = ([BearerTokenInterceptor(token)] if token else []) + list(interceptors)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="trainwire-rpc"),
        interceptors=chain,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            # No SO_REUSEPORT: a second server on a taken port must fail, not share it.
            ("grpc.so_reuseport", 0),
            # Clients ping every 30 s during long export streams to notice a dead server.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ],
    )
    try:
        port = _bind(server, listen, _pem(tls_cert), _pem(tls_key), _pem(tls_client_ca))
        host = SessionHost(state_dir, model_root=model_root, device=device, on_serving=on_serving)
    except BaseException:
        server.stop(None)  # release the port and the worker threads of a refused start
        raise
    on_serving(host.phase not in ("restoring", "failed"))
    add_to_server(TrainingSessionServicer(host), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    server.start()
    address = f"{listen.rsplit(':', 1)[0]}:{port}"
    logger.info(
        "listening on %s (%s%s, state dir %s, device %s)",
        address,
        "mTLS" if tls_client_ca else "TLS" if tls_cert else "plaintext",
        ", token required" if token else "",
        host.state_dir.root,
        host.device,
    )
    threading.Thread(target=host.recover, name="trainwire-recover", daemon=True).start()
    return ServerHandle(server, host, health_servicer, address, port)


def _bind(
    server: grpc.Server, listen: str, cert: bytes | None, key: bytes | None, ca: bytes | None
) -> int:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--listen takes HOST:PORT (port 0 picks a free one), got {listen!r}")
    try:
        if cert is None:
            bound = server.add_insecure_port(listen)
        else:
            credentials = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
            )
            bound = server.add_secure_port(listen, credentials)
    except RuntimeError as error:  # grpc raises RuntimeError when the address is taken
        raise OSError(f"cannot listen on {listen}: {error}") from None
    if not bound:
        raise OSError(f"cannot listen on {listen}")
    return bound


# -- the command line ------------------------------------------------------------------------------


# The server tunables ``trainwire serve --set KEY=VALUE`` may change, with their types.
SERVE_SETTINGS = {"max_message_bytes": int, "max_workers": int, "stop_grace_s": float}


def serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The tunables from the flags, then ``--set`` overrides (unknown keys are refused)."""
    settings: dict[str, Any] = {
        "max_message_bytes": args.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES,
        "max_workers": DEFAULT_MAX_WORKERS,
        "stop_grace_s": DEFAULT_STOP_GRACE_S if args.stop_grace_s is None else args.stop_grace_s,
    }
    valid, invalid = parse_config_overrides(args.set or [])
    if invalid:
        raise ValueError(f"--set takes key=value, got: {', '.join(invalid)}")
    for key, value in valid.items():
        kind = SERVE_SETTINGS.get(key)
        if kind is None:
            raise ValueError(f"--set {key}: unknown; serve takes {', '.join(SERVE_SETTINGS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"--set {key}: must be a positive number, got {value!r}")
        settings[key] = kind(value)
    return settings


def run_serve_command(args: argparse.Namespace) -> int:
    """``trainwire serve``: serve until SIGTERM or SIGINT, then stop gracefully and exit 0."""
    settings = serve_settings(args)
    token = _read_token(args.token_file) if args.token_file else None
    # Signal handlers first: a SIGTERM that arrives while the server starts still stops it cleanly.
    stop_requested = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop_requested.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    handle = serve(
        listen=args.listen,
        state_dir=args.state_dir,
        model_root=args.model_root,
        device=args.device,
        token=token,
        tls_cert=args.tls_cert and Path(args.tls_cert),
        tls_key=args.tls_key and Path(args.tls_key),
        tls_client_ca=args.tls_client_ca and Path(args.tls_client_ca),
        max_message_bytes=settings["max_message_bytes"],
        max_workers=settings["max_workers"],
    )
    if args.port_file:
        write_text_atomic(args.port_file, f"{handle.port}\n")
    while not stop_requested.wait(0.5):
        pass
    logger.info("%s received: finishing the operation in flight, then stopping", received[0])
    handle.stop(grace=settings["stop_grace_s"])
    return 0


def _read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


# ``trainwire.server.serve`` names both this module and the factory above. Importing the module
# rebinds the package attribute to it, so the module object calls the factory too.
class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> ServerHandle:
        return serve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

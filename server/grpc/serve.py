"""The gRPC server behind ``trainwire.server.serve(...)`` and ``trainwire serve`` (in the CLI).

One process, one session host, one executor: the servicer's calls queue on the host's lock. Around
it: standard health (NOT_SERVING while loading or restoring) and reflection, a bearer-token check
on every call but health, TLS or mutual TLS, a cap on request size (a bigger request is
RESOURCE_EXHAUSTED and the server keeps serving), and a graceful stop (``ServerHandle.stop``,
which ``trainwire serve`` calls on SIGTERM): the operation in flight finishes and commits, new
ones are UNAVAILABLE.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from trainwire.client.files import Pem, read_pem
from trainwire.server.grpc.servicer import TrainingSessionServicer, add_to_server
from trainwire.server.service.host import SessionHost
from trainwire.v1 import session_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = session_pb2.DESCRIPTOR.services_by_name["TrainingSessionService"].full_name
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_WORKERS = 32
DEFAULT_STOP_GRACE_S = 60.0


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


def _unparsed(data: bytes) -> bytes:
    """A refused request's "deserializer": the bytes stay unparsed (never None, which grpc
    would report as a deserialization failure, INTERNAL)."""
    return b""


def _refusing_handler(handler, code: grpc.StatusCode, message: str):
    """A handler of ``handler``'s kind that fails every call with ``code``.

    It never parses the request: a caller without the token must not make the server build a
    large message (a tokenless 48 MiB request of tiny examples once cost a gigabyte of memory).
    """

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
                request_deserializer=_unparsed,
                response_serializer=handler.response_serializer,
            )
    return handler


class ServerHandle:
    """A running server: ``port``, ``session_host``, ``stop()`` and ``wait()``."""

    def __init__(
        self,
        server: grpc.Server,
        session_host: SessionHost,
        health_servicer: health.HealthServicer,
        address: str,
        port: int,
    ) -> None:
        self.server = server
        self.session_host = session_host
        self.health = health_servicer
        self.address = address
        self.port = port
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self.tinker: Any = None  # the Tinker front's TinkerListener, when serve() started one

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
            if self.tinker is not None:
                self.tinker.stop()
            self.session_host.begin_shutdown()
            self.health.enter_graceful_shutdown()
            if not self.session_host.wait_idle(grace):
                logger.warning("the operation in flight did not finish within %.1fs", grace)
            self.server.stop(grace=1.0 if grace is None else grace).wait()
            self.session_host.release()
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
    keep_checkpoints: int | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tinker_listen: str | None = None,
    tinker_token: str | None = None,
    tinker_tokenizer_id: str | None = None,
) -> ServerHandle:
    """Start a server on ``listen`` (``HOST:PORT``; port 0 picks a free one) and return its handle.

    It answers at once: a session left open in ``state_dir`` is restored in the background
    (health NOT_SERVING meanwhile). ``tls_*`` take PEM bytes or file paths; ``tls_client_ca``
    requires client certificates signed by it. ``interceptors`` run after the token check.
    ``keep_checkpoints`` turns retention on: a run keeps its K newest checkpoints (and ``best``).
    ``tinker_listen`` (``HOST:PORT``) adds the Tinker SDK front on the same session host
    (``trainwire[tinker]``); ``tinker_token`` is the ``tml-`` key its clients must send;
    ``tinker_tokenizer_id`` is what ``get_tokenizer()`` loads on the client's side (a hub id or
    a path the client can read; None: the model's directory on this host).
    """
    refuse_open_model_paths(model_root, listen, tinker_listen)
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
        port = _bind(server, listen, read_pem(tls_cert), read_pem(tls_key), read_pem(tls_client_ca))
        session_host = SessionHost(
            state_dir,
            model_root=model_root,
            device=device,
            on_serving=on_serving,
            keep_checkpoints=keep_checkpoints,
        )
    except BaseException:
        server.stop(None)  # release the port and the worker threads of a refused start
        raise
    on_serving(session_host.phase not in ("restoring", "failed"))
    add_to_server(TrainingSessionServicer(session_host), server)
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
        session_host.state_dir.root,
        session_host.device,
    )
    handle = ServerHandle(server, session_host, health_servicer, address, port)
    if tinker_listen is not None:
        from trainwire.server.tinker.listener import TinkerListener  # the optional extra

        try:
            handle.tinker = TinkerListener(
                session_host, tinker_listen, token=tinker_token, tokenizer_id=tinker_tokenizer_id
            )
        except BaseException:
            server.stop(None)
            session_host.release()
            raise
    threading.Thread(target=session_host.recover, name="trainwire-recover", daemon=True).start()
    return handle


def is_loopback(listen: str) -> bool:
    """``HOST:PORT`` names a loopback host (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or a wildcard: reachable from elsewhere


def refuse_open_model_paths(model_root: str | Path | None, *listens: str | None) -> None:
    """A server reachable beyond loopback must confine model paths: without a model root, any
    client could have it open any local directory, and its messages would name server paths."""
    exposed = [listen for listen in listens if listen is not None and not is_loopback(listen)]
    if model_root is None and exposed:
        raise ValueError(
            f"--model-root is required when listening beyond loopback ({', '.join(exposed)}): "
            "without it a client could open any path on this machine. Give the directory that "
            "holds the models (model paths then resolve under it), or listen on 127.0.0.1"
        )


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

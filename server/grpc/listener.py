"""The gRPC listener: one ``grpc.Server`` carrying the servicer, standard health (NOT_SERVING
while the host loads or restores) and reflection, behind the bearer-token check, on plaintext,
TLS or mutual TLS, with a cap on request size (a bigger request is RESOURCE_EXHAUSTED and the
server keeps serving).

It binds its port before the process builds the session host, so a taken port fails a start
before anything touches the state directory; ``attach`` then serves a host.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from trainwire.contract.files import Pem, read_pem
from trainwire.server.grpc.auth import BearerTokenInterceptor
from trainwire.server.grpc.run_access import RunAccess
from trainwire.server.grpc.servicer import TrainingSessionServicer, add_to_server
from trainwire.server.listen_address import split_listen
from trainwire.server.serve_defaults import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_WORKERS
from trainwire.server.service.host import SessionHost
from trainwire.server.service.scheduler import DEFAULT_MAX_QUEUED
from trainwire.server.service.tenants import Tenants, tenants_of
from trainwire.v1 import session_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = session_pb2.DESCRIPTOR.services_by_name["TrainingSessionService"].full_name
# A connection that has not finished its HTTP/2 handshake by then is closed: strangers cannot
# hold the process's descriptors with half-open connections (a client finishes in milliseconds).
HANDSHAKE_TIMEOUT_S = 10.0


class GrpcListener:
    """A bound (not yet serving) gRPC server on ``listen``: ``port``, ``address``, ``tls``."""

    def __init__(
        self,
        listen: str,
        *,
        token: str | Tenants | None = None,
        tls_cert: Pem | None = None,
        tls_key: Pem | None = None,
        tls_client_ca: Pem | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_workers: int = DEFAULT_MAX_WORKERS,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both a certificate and its key")
        if tls_client_ca is not None and tls_cert is None:
            raise ValueError(
                "client certificate checks (tls_client_ca) need TLS: give tls_cert/key"
            )
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be at least 1024, got {max_message_bytes}")
        self.health = health.HealthServicer()
        self.tls = "mTLS" if tls_client_ca else "TLS" if tls_cert else "plaintext"
        self.token_required = bool(token)
        chain = ([BearerTokenInterceptor(token)] if token else []) + list(interceptors)
        self.max_workers = rpc_threads(max_workers, tenants_of(token))
        # Its own pool, shut down when it stops: grpc never stops a pool it was given, so each
        # stopped server left its handler threads behind in the process that embedded it.
        self.handlers = futures.ThreadPoolExecutor(
            self.max_workers, thread_name_prefix="trainwire-rpc"
        )
        self.server = grpc.server(
            self.handlers,
            interceptors=chain,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                # No SO_REUSEPORT: a second server on a taken port must fail, not share it.
                ("grpc.so_reuseport", 0),
                # Clients ping every 30 s during long export streams to notice a dead server.
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
            ],
        )
        try:
            pems = read_pem(tls_cert), read_pem(tls_key), read_pem(tls_client_ca)
            self.port = _bind(self.server, listen, *pems)
        except BaseException:
            self.server.stop(None)  # release the threads of a refused start
            self.handlers.shutdown(wait=False)
            raise
        self.address = f"{listen.rsplit(':', 1)[0]}:{self.port}"

    def set_serving(self, serving: bool) -> None:
        """Health for the whole server and the session service: SERVING or NOT_SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )  # fmt: skip
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def attach(self, session_host: SessionHost, access: RunAccess | None = None) -> None:
        """Serve ``session_host``'s operation table (each tenant its own run, with ``access``),
        health and reflection, from now on."""
        add_to_server(TrainingSessionServicer(session_host, access), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.server.start()

    def enter_graceful_shutdown(self) -> None:
        """Health says NOT_SERVING for good: a load balancer stops sending calls here."""
        self.health.enter_graceful_shutdown()

    def stop(self, grace: float | None) -> None:
        """Stop taking calls; the ones running get ``grace`` seconds (None: none). The handler
        threads end once their calls return."""
        self.server.stop(grace).wait()
        self.handlers.shutdown(wait=False)


def rpc_threads(max_workers: int, tenants: Tenants | None) -> int:
    """The handler threads of a port: ``max_workers`` for the first tenant (or none), and one
    scheduler bound of waiting calls more for each other tenant, so each tenant can fill its own
    bound (``Scheduler.admitted``) and the threads kept free for health and Info stay free
    (threads are started only when calls need them)."""
    others = len(tenants) - 1 if tenants is not None else 0
    return max_workers + others * DEFAULT_MAX_QUEUED


def _bind(
    server: grpc.Server, listen: str, cert: bytes | None, key: bytes | None, ca: bytes | None
) -> int:
    split_listen(listen, "--listen")
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

"""One server process: the session host with both transports attached, and its graceful stop.

``serve(...)`` (``trainwire.server.serve`` and ``trainwire serve``) builds, in this order: the
gRPC listener (binding its port first, so a taken port fails before the state directory is
touched), the session host (which takes the state directory), the Tinker front when asked, and
then restores a run left open in the background (health NOT_SERVING meanwhile). Both transports
reach the engine only through the host's operation table. ``ServerHandle.stop`` (which
``trainwire serve`` calls on SIGTERM) lets the operation in flight finish and commit; new ones are
UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from trainwire.contract.files import Pem
from trainwire.server.engine.session import TrainingSession
from trainwire.server.grpc.listener import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_WORKERS,
    GrpcListener,
)
from trainwire.server.grpc.run_access import RunAccess
from trainwire.server.library_warnings import quiet_library_warnings
from trainwire.server.port_keys import is_loopback, port_keys
from trainwire.server.service.host import SessionFactory, SessionHost
from trainwire.server.service.run_owners import RunOwners
from trainwire.server.service.tenants import Tenants, tenants_of

logger = logging.getLogger(__name__)


class ServerHandle:
    """A running server: ``port``, ``session_host``, ``stop()`` and ``wait()``."""

    def __init__(self, grpc_listener: GrpcListener, session_host: SessionHost) -> None:
        self.grpc_listener = grpc_listener
        self.session_host = session_host
        self.address = grpc_listener.address
        self.port = grpc_listener.port
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
            self.grpc_listener.enter_graceful_shutdown()
            if not self.session_host.wait_idle(grace):
                logger.warning("the operation in flight did not finish within %.1fs", grace)
            self.grpc_listener.stop(1.0 if grace is None else grace)
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
    token: str | Tenants | None = None,
    *,
    tls_cert: Pem | None = None,
    tls_key: Pem | None = None,
    tls_client_ca: Pem | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_workers: int = DEFAULT_MAX_WORKERS,
    keep_checkpoints: int | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tinker_listen: str | None = None,
    tinker_token: str | Tenants | None = None,
    tinker_tokenizer_id: str | None = None,
    tenants: Tenants | None = None,
    sample_batching: bool = True,
    session_factory: SessionFactory | None = None,
    health_gate: Callable[[Callable[[bool], None]], Callable[[bool], None]] | None = None,
    max_runs: int = 1,
) -> ServerHandle:
    """Start a server on ``listen`` (``HOST:PORT``; port 0 picks a free one) and return its handle.

    It answers at once: a session left open in ``state_dir`` is restored in the background
    (health NOT_SERVING meanwhile). ``tls_*`` take PEM bytes or file paths; ``tls_client_ca``
    requires client certificates signed by it. ``interceptors`` run after the token check.
    ``keep_checkpoints`` turns retention on: a run keeps its K newest checkpoints (and ``best``).
    ``tinker_listen`` (``HOST:PORT``) adds the Tinker SDK front on the same session host
    (``trainwire[tinker]``); ``tinker_token`` is the ``tml-`` key its clients must send;
    ``tenants`` guards both ports with one map of tenants (``server/service/tenants.py``), each
    seeing only its own runs; ``token`` and ``tinker_token`` may be such a map too, each for its
    own port (tenants are then matched by name across the two); beside a front, both ports
    have keys or neither does (``server/port_keys.py``: ValueError before anything starts);
    ``tinker_tokenizer_id`` is what ``get_tokenizer()`` loads on the client's side (a hub id or
    a path the client can read; None: the model's directory on this host).
    ``sample_batching`` False decodes each sample request alone (see ``SessionHost``).
    ``session_factory`` builds the sessions (rank 0 of a group: ``GroupLeader.open_session``).
    ``health_gate`` takes the listener's health signal and returns the one the host drives (rank
    0 of a group: ``GroupHealth.gate``, NOT_SERVING while another rank is silent).
    ``max_runs`` above 1 holds up to that many LoRA runs of one base model at once (gRPC; not
    yet beside the Tinker front, whose SDK clients share one model, nor in a sharded group).
    """
    keys = port_keys(tinker_listen, tenants, token, tinker_token)
    token, tinker_token = keys.grpc, keys.tinker
    refuse_open_model_paths(model_root, listen, tinker_listen)
    refuse_many_runs_where_not_served(max_runs, session_factory)
    quiet_library_warnings()
    listener = GrpcListener(
        listen,
        token=token,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        max_message_bytes=max_message_bytes,
        max_workers=max_workers,
        interceptors=interceptors,
    )
    set_serving = listener.set_serving if health_gate is None else health_gate(listener.set_serving)
    try:
        session_host = SessionHost(
            state_dir,
            model_root=model_root,
            device=device,
            on_serving=set_serving,
            keep_checkpoints=keep_checkpoints,
            sample_batching=sample_batching,
            session_factory=session_factory or TrainingSession,
            max_runs=max_runs,
        )
    except BaseException:
        listener.stop(None)  # release the port of a refused start
        raise
    try:
        owners = run_owners_of(session_host, token, tinker_token)
    except BaseException:
        listener.stop(None)
        session_host.release()
        raise
    set_serving(session_host.phase not in ("restoring", "failed"))
    grpc_tenants = tenants_of(token)
    access = None
    if owners is not None and grpc_tenants is not None:
        access = RunAccess(grpc_tenants, owners, session_host)
    weighted = tenants or grpc_tenants
    if owners is not None and weighted is not None:
        session_host.run_weight = partial(tenant_weight, weighted, owners)
    listener.attach(session_host, access)
    logger.info(
        "listening on %s (%s%s, state dir %s, device %s)",
        listener.address,
        listener.tls,
        ", token required" if token else "",
        session_host.state_dir.root,
        session_host.device,
    )
    handle = ServerHandle(listener, session_host)
    if tinker_listen is not None:
        handle.tinker = _start_tinker(
            session_host, listener, tinker_listen, tinker_token, tinker_tokenizer_id, owners
        )
    threading.Thread(target=session_host.recover, name="trainwire-recover", daemon=True).start()
    return handle


def _start_tinker(
    session_host: SessionHost,
    listener: GrpcListener,
    listen: str,
    token: str | Tenants | None,
    tokenizer_id: str | None,
    owners: RunOwners | None,
) -> Any:
    """The Tinker front on the same host; a refused start stops what was started before it."""
    from trainwire.server.tinker.listener import TinkerListener  # the optional extra

    try:
        return TinkerListener(
            session_host,
            listen,
            state_dir=session_host.state_dir.root,
            model_root=session_host.model_root,
            token=token,
            tokenizer_id=tokenizer_id,
            owners=owners,
        )
    except BaseException:
        listener.stop(None)
        session_host.release()
        raise


def tenant_weight(tenants: Tenants, owners: RunOwners, run_id: str) -> float:
    """The share of the scheduler's turns of ``run_id``: its tenant's weight (1.0 for a run of
    no tenant in the map, as one the single key opened)."""
    if not run_id:  # the one lane of a server of one run: no share to weigh
        return 1.0
    owner = owners.owner(run_id)
    return tenants.weight_of(owner) if owner is not None and owner in tenants else 1.0


def run_owners_of(
    host: SessionHost, token: str | Tenants | None, tinker_token: str | Tenants | None
) -> RunOwners | None:
    """Who owns each run, when some port has a map of tenants; None when every key is the
    one-tenant form (or there is none): then every run is everybody's, as before tenants."""
    if not any(isinstance(keys, Tenants) for keys in (token, tinker_token)):
        return None
    return RunOwners(host.state_dir)


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


def refuse_many_runs_where_not_served(
    max_runs: int, session_factory: SessionFactory | None
) -> None:
    """ValueError for ``--max-runs`` above 1 in a sharded group: its ranks run one session in
    lockstep, each rank holding its shard of one model's state, so runs side by side would
    multiply what every rank holds and serialize every run behind every collective."""
    if max_runs != 1 and session_factory is not None:
        raise ValueError(
            f"--max-runs {max_runs} with --nproc: a sharded group runs one session across its "
            "ranks; leave --max-runs out there"
        )

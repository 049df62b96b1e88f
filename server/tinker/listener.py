"""The Tinker HTTP listener: uvicorn on its own thread, in the gRPC server's process."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import uvicorn

from trainwire.server.listen_address import split_listen
from trainwire.server.service.host import SessionHost
from trainwire.server.service.run_owners import RunOwners
from trainwire.server.service.tenants import Tenants, tenants_of
from trainwire.server.tinker.app import create_app
from trainwire.server.tinker.auth import check_token
from trainwire.server.tinker.connections import bounded_protocol
from trainwire.server.tinker.startup import start_front, stop_front

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0


class TinkerListener:
    """A running Tinker front: ``port``, ``front`` and ``stop()``."""

    def __init__(
        self,
        host: SessionHost,
        listen: str,
        *,
        state_dir: Path,
        model_root: Path | None,
        token: str | Tenants | None = None,
        tokenizer_id: str | None = None,
        owners: RunOwners | None = None,
    ) -> None:
        check_token(token)
        address, port = split_listen(listen, "--tinker-listen")
        self.front = start_front(
            host,
            state_dir,
            model_root=model_root,
            tokenizer_id=tokenizer_id,
            tenants=tenants_of(token),
            owners=owners,
        )
        self.app = create_app(self.front, token=token)
        config = uvicorn.Config(
            self.app,
            host=address,
            port=port,
            log_level="warning",
            lifespan="off",
            # Bounded connections (strangers' apart), a deadline for each request's head.
            http=bounded_protocol(tenants_of(token)),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="tinker-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError(f"cannot listen on {listen} for the Tinker front")
            if time.monotonic() > deadline:
                raise OSError(f"the Tinker front did not start on {listen}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        self.address = f"{address}:{self.port}"
        logger.info("Tinker front on http://%s%s", self.address, " (key required)" if token else "")

    @property
    def base_url(self) -> str:
        return f"http://{self.address}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        stop_front(self.front)

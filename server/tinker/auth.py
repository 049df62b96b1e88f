"""The SDK's credential: ``X-API-Key``, a tenant's key (a single key is the one-tenant form).

The SDK itself refuses keys that do not start with ``tml-``, so a front's single key must too
(checked at start-up), and a tenant whose key does not can reach the front only without the SDK
(it uses gRPC).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from trainwire.server.service.tenants import Tenant, Tenants, tenants_of
from trainwire.server.tinker.tenancy import calling

logger = logging.getLogger(__name__)

KEY_PREFIX = "tml-"
MISSING_KEY = "missing API key: send it as X-API-Key (TINKER_API_KEY for the SDK)"
WRONG_KEY = "wrong API key"
CLOSE = {"Connection": "close"}


def check_token(token: str | Tenants | None) -> None:
    """ValueError for a key the SDK could never send: a single key, or every tenant's (a
    tenant whose key lacks the prefix is told it can use gRPC only)."""
    if token is None:
        return
    if isinstance(token, str):
        if not token.startswith(KEY_PREFIX):
            raise ValueError(
                f"the Tinker token must start with {KEY_PREFIX!r} (the SDK refuses other keys); "
                f"got one starting {token[:4]!r}"
            )
        return
    grpc_only = [tenant.name for tenant in token if not tenant.key.startswith(KEY_PREFIX)]
    if len(grpc_only) == len(token):
        raise ValueError(
            f"no tenant's key starts with {KEY_PREFIX!r}, so no Tinker SDK client could use the "
            "front (the SDK refuses other keys): give SDK users 'tml-' keys"
        )
    for name in grpc_only:
        logger.warning(
            "tenant %r: its key does not start with %r, which the Tinker SDK refuses: it can "
            "use gRPC only",
            name,
            KEY_PREFIX,
        )


def refusal(supplied: str | None, tenants: Tenants | None) -> tuple[str | None, Tenant | None]:
    """Why a request is refused (None: it may pass) and whose key it carries; constant time
    in the key (``Tenants.by_key``)."""
    if tenants is None:
        return None, None
    if not supplied:
        return MISSING_KEY, None
    tenant = tenants.by_key(supplied)
    return (None, tenant) if tenant is not None else (WRONG_KEY, None)


class RequireKey:
    """ASGI middleware: 401 with the reason for an HTTP request without a tenant's key (and the
    connection closed with it); the request runs as that tenant's (``tenancy.calling``).

    The ``exempt`` routes check a credential of their own (a signed download URL: urllib, which
    the cookbook downloads with, sends no key); a key sent there anyway must be a tenant's, and
    the route then answers that tenant only.

    Plain ASGI rather than ``@app.middleware("http")``, which streams every response through
    an extra task: a cost on each of the SDK's polls.
    """

    def __init__(
        self, app: ASGIApp, token: str | Tenants | None, exempt: str | None = None
    ) -> None:
        self.app = app
        self.tenants = tenants_of(token)
        self.exempt = exempt  # a path prefix whose routes check a credential of their own

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        supplied: Any = dict(scope["headers"]).get(b"x-api-key")
        key = supplied.decode("latin-1") if supplied else None
        exempt = self.exempt is not None and scope.get("path", "").startswith(self.exempt)
        why, tenant = refusal(key, self.tenants)
        if why is not None and not (exempt and key is None):
            # The connection closes with the answer: a stranger keeps no connection by asking
            # again and again (``connections``' budget for connections without a key).
            refused = JSONResponse({"detail": why}, status_code=401, headers=CLOSE)
            await refused(scope, receive, send)
            return
        with calling(tenant.name if tenant is not None else None):
            await self.app(scope, receive, send)

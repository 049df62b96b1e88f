"""The SDK's credential: ``X-API-Key``. The SDK itself refuses keys that do not start with
``tml-``, so the server's token for SDK clients must too (checked at start-up)."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

KEY_PREFIX = "tml-"


def check_token(token: str | None) -> None:
    """ValueError for a token the SDK could never send."""
    if token is not None and not token.startswith(KEY_PREFIX):
        raise ValueError(
            f"the Tinker token must start with {KEY_PREFIX!r} (the SDK refuses other keys); "
            f"got one starting {token[:4]!r}"
        )


def refusal(supplied: str | None, expected: str | None) -> str | None:
    """Why a request is refused (None: it may pass); constant time in the key."""
    if expected is None:
        return None
    if not supplied:
        return "missing API key: send it as X-API-Key (TINKER_API_KEY for the SDK)"
    if hmac.compare_digest(supplied.encode(), expected.encode()):
        return None
    return "wrong API key"


class RequireKey:
    """ASGI middleware: 401 with the reason for an HTTP request without the right key.

    Plain ASGI rather than ``@app.middleware("http")``, which streams every response through
    an extra task: a cost on each of the SDK's polls.
    """

    def __init__(self, app: ASGIApp, token: str | None, exempt: str | None = None) -> None:
        self.app = app
        self.token = token
        self.exempt = exempt  # a path prefix whose routes check a credential of their own

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exempt = self.exempt is not None and scope.get("path", "").startswith(self.exempt)
        if scope["type"] == "http" and not exempt:
            supplied: Any = dict(scope["headers"]).get(b"x-api-key")
            why = refusal(supplied.decode("latin-1") if supplied else None, self.token)
            if why is not None:
                await JSONResponse({"detail": why}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

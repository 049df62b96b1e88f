"""The HTTP front's bound on request bodies, enforced while they arrive.

A Content-Length over the bound is refused before a byte is read; a body that grows past it
(chunked, or a lying header) is refused as soon as it does. 413, which the SDK does not retry:
the same body would be refused again.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainwire.server.errors import RequestTooLarge
from trainwire.server.tinker.codec import MAX_FORWARD_BACKWARD_BYTES

MAX_JSON_BYTES = 16 * 1024 * 1024  # a JSON body (a sample's prompt of the most tokens fits)
PROTOBUF_ROUTES = ("/forward_backward",)  # bounded by the largest valid forward_backward


def body_limit(path: str) -> int:
    return MAX_FORWARD_BACKWARD_BYTES if path.endswith(PROTOBUF_ROUTES) else MAX_JSON_BYTES


class LimitBody:
    """ASGI middleware: 413 for an HTTP request whose body passes ``body_limit(path)``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = body_limit(scope["path"])
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await refuse(limit)(scope, receive, send)
            return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge(too_large(limit))
            return message

        await self.app(scope, bounded, send)


def too_large(limit: int) -> str:
    return f"the request body is over {limit} bytes, this server's bound for it"


def refuse(limit: int) -> JSONResponse:
    return JSONResponse({"detail": too_large(limit)}, status_code=413)

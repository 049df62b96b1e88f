"""The gRPC transport's bearer-token check: every call but health needs a tenant's key (a
single token is the one-tenant form, ``Tenants.single``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from trainwire.server.service.tenants import Tenant, Tenants, tenants_of

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
BEARER = "Bearer "


def caller_of(tenants: Tenants, metadata: Iterable[tuple[str, Any]] | None) -> Tenant | None:
    """The tenant whose key a call's ``authorization: Bearer <key>`` carries, or None (every
    key compared in constant time: ``Tenants.by_key``)."""
    supplied = str(dict(metadata or ()).get("authorization", ""))
    if not supplied.startswith(BEARER):
        return None
    return tenants.by_key(supplied[len(BEARER) :])


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call but health without ``authorization: Bearer <key>`` of a tenant."""

    def __init__(self, token: str | Tenants) -> None:
        if not token:
            raise ValueError("the bearer token is empty")
        self._tenants = tenants_of(token)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        metadata = handler_call_details.invocation_metadata
        if caller_of(self._tenants, metadata) is not None:
            return handler
        supplied = dict(metadata or ()).get("authorization", "")
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

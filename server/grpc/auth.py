"""The gRPC transport's bearer-token check: every call but health needs the server's token."""

from __future__ import annotations

import hmac

import grpc

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


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

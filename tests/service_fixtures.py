"""Helpers the service tests share: real servers on loopback, clients, keyed op sequences.

Import what a test module needs (``from service_fixtures import ...``); the tiny models and
config factories come from conftest.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from trainwire.client import InputExample, SessionClient
from trainwire.client.session.retry import RetryPolicy
from trainwire.server.process import ServerHandle, serve
from trainwire.testing import tiny_sentiment_examples, tiny_text_examples

FAST_RETRY = RetryPolicy(max_attempts=5, initial_backoff_s=0.01, max_backoff_s=0.1)
NO_RETRY = RetryPolicy(max_attempts=1)
TEXTS = tiny_text_examples(24, seed=3)
REVIEWS = tiny_sentiment_examples(24, seed=3)


@contextlib.contextmanager
def running_server(state_dir: Path, model_root: Path, **options: Any) -> Iterator[ServerHandle]:
    """``serve(...)`` on a free loopback port, stopped at the end of the block."""
    handle = serve(
        listen="127.0.0.1:0", state_dir=state_dir, model_root=model_root, device="cpu", **options
    )
    try:
        yield handle
    finally:
        handle.stop(grace=10)


def connect(handle_or_port: ServerHandle | int, **options: Any) -> SessionClient:
    """A client of the server, once it is SERVING; fast retries unless ``retry`` is given."""
    port = handle_or_port if isinstance(handle_or_port, int) else handle_or_port.port
    options.setdefault("retry", FAST_RETRY)
    options.setdefault("timeout_s", 60)
    client = SessionClient(f"127.0.0.1:{port}", **options)
    client.wait_until_serving(timeout_s=60)
    return client


def wait_for(condition: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Poll ``condition`` until it is true; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still false after {timeout_s}s: {condition}"
        time.sleep(0.01)


def microbatches(examples: list[InputExample], size: int = 3) -> list[list[InputExample]]:
    return [examples[i : i + size] for i in range(0, len(examples), size)]


def training_ops(examples: list[InputExample], *, accumulate: int = 2) -> list[tuple[str, Any]]:
    """A keyed op sequence: forward_backward per microbatch, optim_step every ``accumulate``."""
    ops: list[tuple[str, Any]] = []
    for index, batch in enumerate(microbatches(examples)):
        ops.append(("forward_backward", batch))
        if (index + 1) % accumulate == 0:
            ops.append(("optim_step", None))
    return ops


def apply_remote(
    client: SessionClient,
    ops: list[tuple[str, Any]],
    prefix: str,
    *,
    first: int = 0,
    position: int | None = None,
) -> list[Any]:
    """Apply ``ops[first:]`` through ``client`` with keys ``{prefix}/{index}``.

    Each carries its expected position: ``position`` (default: ``first``) for the first one.
    """
    outcomes = []
    expected = first if position is None else position
    for i, (kind, batch) in enumerate(ops[first:], start=first):
        key = f"{prefix}/{i}"
        if kind == "forward_backward":
            outcome = client.forward_backward(batch, operation_key=key, expected_position=expected)
        else:
            outcome = client.optim_step(operation_key=key, expected_position=expected)
        outcomes.append(outcome)
        expected = outcome.position
    return outcomes


def apply_local(session: Any, ops: list[tuple[str, Any]]) -> list[Any]:
    """The same ops on an in-process TrainingSession: losses and step results."""
    return [
        session.forward_backward(batch) if kind == "forward_backward" else session.optim_step()
        for kind, batch in ops
    ]


class DropFirstResponse(grpc.ServerInterceptor):
    """Lets the server apply a keyed call, then loses its response (once per key)."""

    def __init__(self) -> None:
        self.dropped: set[str] = set()

    def _should_drop(self, request) -> bool:
        key = request.operation.operation_key if hasattr(request, "operation") else ""
        if not key or key in self.dropped:
            return False
        self.dropped.add(key)
        return True

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or (handler.unary_stream is None and handler.unary_unary is None):
            return handler

        def unary(request, context):
            response = handler.unary_unary(request, context)
            if self._should_drop(request):
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected: response lost")
            return response

        def stream(request, context):
            responses = list(handler.unary_stream(request, context))
            if self._should_drop(request):
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected: stream lost")
            yield from responses

        kind, behavior = ("unary_unary", unary) if handler.unary_unary else ("unary_stream", stream)
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            behavior,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

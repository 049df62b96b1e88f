"""The HTTP routes the Tinker SDK calls: each reads the body and calls its route function
(``training_routes``, ``sampling_routes``) or the model table.

Every route that writes the front's request store (an fsync) runs on a worker thread, never on
the event loop that answers polls. Errors: a caller's mistake is 400 (the SDK does not retry it)
or 404 with ``detail`` saying what to do; a body past its bound 413 (see ``limits``); a wrong
key 401; a full queue 429 and a restoring server 503 (the SDK retries both): the statuses of
``errors.STATUSES``, the map the gRPC servicer uses too.
Errors of a call that was accepted come back through its future as ``{"error", "category"}``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from trainwire.server.errors import InvalidArgument, NotFound, TrainwireError, status_of
from trainwire.server.service.results import Deferred, Done, settled
from trainwire.server.service.tenants import Tenants
from trainwire.server.tinker import (
    account_routes,
    checkpoint_routes,
    codec,
    copy_routes,
    external_weights,
    publish_routes,
    sampling_futures,
    sampling_routes,
    session_routes,
    training_routes,
)
from trainwire.server.tinker.auth import RequireKey
from trainwire.server.tinker.fields import get_str
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.limits import LimitBody
from trainwire.server.tinker.tenancy import visible

API = "/api/v1"
# The training calls with a JSON body, each answered with the request id its route queued.
SEQUENCED_JSON_ROUTES: dict[str, Callable[[TinkerFront, dict[str, Any]], str]] = {
    "optim_step": training_routes.optim_step,
    "save_weights": training_routes.save_weights,
    "load_weights": training_routes.load_weights,
    "save_weights_for_sampler": sampling_routes.save_weights_for_sampler,
    "save_weights_external": external_weights.save_weights_external,
}
# Why a custom loss never runs here (client/config says so, and the SDK then runs it itself).
CUSTOM_LOSS_ON_THE_CLIENT = (
    "create_custom_loss: this server runs custom losses on the client (client/config "
    "custom_loss_server_side is false): a traced graph sent by a client is code the server "
    "would execute; the SDK runs the loss itself on the trainer's logprobs from a forward, and "
    "the update is a forward_backward weighted by the loss's gradient (the same gradients)"
)
DEFAULT_POLL_HOLD_S = 20.0  # under the SDK's 45 s poll timeout
# forward_backward bodies decoded at once (inflated, parsed, their datums built); the rest wait
# their turn, holding only the body they sent. Decoding is Python work under the GIL, so more
# at once would be no faster, only hold more: at most this many inflated bodies (each within
# ``codec.MAX_FORWARD_BACKWARD_BYTES``) and their decoded datums exist at a time. Waiting rather
# than 429: the SDK sends a batch's chunks together, and each decode is short and bounded.
MAX_DECODING = 2
MAX_JSON_DEPTH = 64  # a Tinker request nests a few levels; far below Python's recursion limit
CONTAINERS = (dict, list)  # what JSON nests


def read_json_object(raw: bytes) -> dict[str, Any]:
    """A request's JSON object, or InvalidArgument (400) saying what is wrong with it.

    Nesting deeper than ``MAX_JSON_DEPTH`` is the caller's malformed input: parsed, 100,000
    levels are a RecursionError (a 500 the SDK would retry), and even fewer would be a
    RecursionError later, wherever the body is read, logged or read back after a restart."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidArgument(too_deep()) from None
    except ValueError as error:  # not JSON, or not UTF-8
        raise InvalidArgument(f"the body is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidArgument("the body must be a JSON object")
    # Counting brackets is C-speed; only a body with more of them than the bound can be too deep.
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_JSON_DEPTH and nesting_depth(data) > MAX_JSON_DEPTH:
        raise InvalidArgument(too_deep())
    return data


async def json_body(request: Request) -> dict[str, Any]:
    """A JSON route's body object. Only forward_backward inflates a Content-Encoding: a JSON
    route refuses one (400) before reading the body, rather than parse compressed bytes."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidArgument(
            f"this route takes a plain JSON body; Content-Encoding {encoding!r} is only for "
            "forward_backward"
        )
    return read_json_object(await request.body())


def nesting_depth(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (a scalar is 0), walked without recursion."""
    if not isinstance(value, CONTAINERS):
        return 0
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break  # how much deeper does not matter
        children = item.values() if isinstance(item, dict) else item
        # Only containers are queued: a prompt of a million ids is one pass over ints.
        pending.extend((child, depth + 1) for child in children if isinstance(child, CONTAINERS))
    return deepest


def too_deep() -> str:
    return (
        f"the JSON body nests more than {MAX_JSON_DEPTH} levels deep; no Tinker request does: "
        "send the request the SDK builds"
    )


def create_app(
    front: TinkerFront, *, token: str | Tenants | None, poll_hold_s: float = DEFAULT_POLL_HOLD_S
) -> FastAPI:
    app = FastAPI(title="trainwire Tinker front", docs_url=None, redoc_url=None)
    decoding = asyncio.Semaphore(MAX_DECODING)

    app.add_middleware(LimitBody)
    # Added last: runs first, before any body is read. A signed download URL is its own
    # credential (urllib, which the cookbook downloads with, sends no key).
    app.add_middleware(RequireKey, token=token, exempt=external_weights.DOWNLOAD_ROUTE)

    async def refuse(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=status_of(error).http)

    # The caller's errors are answered quietly; anything else is a 500 with its traceback logged.
    app.add_exception_handler(TrainwireError, refuse)
    app.add_exception_handler(ValueError, refuse)
    app.add_exception_handler(Exception, refuse)

    def future(request_id: str, **extra: Any) -> dict[str, Any]:
        return {"request_id": request_id, **extra}

    @app.post(f"{API}/client/config")
    async def client_config() -> dict[str, Any]:
        # JWT exchange and server-side custom losses off (neither exists here). Clone ids from
        # join_sampling_session on. The sampling poller (retrieve_futures) is served but left
        # off: each poll looks through every result held for its client's, so per-request
        # polls (the SDK's default) were no slower with 40 samples and do not grow with what
        # the server holds.
        return {
            "pjwt_auth_enabled": False,
            "custom_loss_server_side": False,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": True,
        }

    @app.post(f"{API}/create_custom_loss")
    async def create_custom_loss() -> None:
        raise InvalidArgument(CUSTOM_LOSS_ON_THE_CLIENT)

    @app.get(f"{API}/healthz")
    async def healthz() -> JSONResponse:
        phase = front.host.phase
        if phase in ("restoring", "failed"):
            return JSONResponse({"detail": f"the session is {phase}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return account_routes.capabilities(front)

    @app.post(f"{API}/create_session")
    async def create_session() -> dict[str, Any]:
        session_id = await run_in_threadpool(front.models.create_session)
        return {"type": "create_session", "session_id": session_id}

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        front.models.require_session(get_str(await json_body(request), "session_id", "") or "")
        return {"type": "session_heartbeat"}

    @app.post(f"{API}/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(session_id: str) -> dict[str, Any]:
        await run_in_threadpool(front.models.finish_session, session_id)
        return {}

    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        data = await json_body(request)
        request_id = await run_in_threadpool(front.models.create_model, data)
        return future(request_id, model_id=request_id.removesuffix("/create"))

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        model_id = get_str(await json_body(request), "model_id", "") or ""
        return front.models.require_model(model_id).info()

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        raw = await request.body()
        encoding = request.headers.get("content-encoding", "")
        async with decoding:  # read first: a slow sender never holds a turn
            route = training_routes.forward_backward
            return future(await run_in_threadpool(route, front, raw, encoding))

    def queued_json_route(
        route: Callable[[TinkerFront, dict[str, Any]], str],
    ) -> Callable[..., Any]:
        """A training call with a JSON body: its route queues it and answers its request id."""

        async def call(request: Request) -> dict[str, Any]:
            return future(await run_in_threadpool(route, front, await json_body(request)))

        return call

    for name, route in SEQUENCED_JSON_ROUTES.items():
        app.post(f"{API}/{name}", name=name)(queued_json_route(route))

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        data = await json_body(request)
        sampling_id = await run_in_threadpool(sampling_routes.create_sampling_session, front, data)
        return {"type": "create_sampling_session", "sampling_session_id": sampling_id}

    @app.get(f"{API}/samplers/{{sampling_id}}")
    async def sampler(sampling_id: str) -> dict[str, Any]:
        found = front.sampling_sessions.get(sampling_id)
        return {
            "sampler_id": found.sampling_session_id,
            "base_model": found.base_model,
            "model_path": found.model_path,
        }

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        data = await json_body(request)
        request_id, sequence_ids = await run_in_threadpool(sampling_routes.asample, front, data)
        return future(request_id, sample_sequence_ids=sequence_ids)

    checkpoint_routes_of(app, front)
    publish_routes.register(app, front)
    session_routes.register(app, front, json_body)
    account_routes.register(app, front)
    sampling_futures.register(app, front, json_body, hold_s=poll_hold_s)

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        request_id = get_str(await json_body(request), "request_id", "") or ""
        try:
            if not visible(request_id):  # another tenant's future: as if there were none
                raise KeyError(request_id)
            outcome = await front.intake.results.wait(request_id, poll_hold_s)
        except KeyError:
            raise NotFound(f"no request {request_id!r} on this server") from None
        if outcome is None:
            payload = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            return JSONResponse(payload)
        if isinstance(outcome, Done) and isinstance(outcome.body, Deferred):
            outcome = await run_in_threadpool(settled, outcome)  # encoded on a worker thread
        if isinstance(outcome, Done):
            if isinstance(outcome.body, bytes):
                return Response(outcome.body, media_type=codec.PROTOBUF)
            return JSONResponse(outcome.body)
        return JSONResponse(outcome.body())

    @app.post(f"{API}/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        data, key = await json_body(request), request.headers.get("x-idempotency-key")
        return await run_in_threadpool(copy_routes.copy_weights, front, data, key)

    @app.post(f"{API}/cancel_future")
    async def cancel_future(request: Request) -> JSONResponse:
        request_id = get_str(await json_body(request), "request_id", "") or ""
        cancelled = await run_in_threadpool(sampling_routes.cancel_sample, front, request_id)
        return JSONResponse({"type": "cancel_future", "cancelled": cancelled})

    return app


def checkpoint_routes_of(app: FastAPI, front: TinkerFront) -> None:
    """The REST calls on training runs and checkpoints, and the signed weights download."""
    runs, segment = f"{API}/training_runs", "{kind}/{name}"

    @app.get(runs)
    async def list_runs(limit: str = "20", offset: str = "0") -> dict[str, Any]:
        return await run_in_threadpool(checkpoint_routes.list_training_runs, front, limit, offset)

    @app.get(f"{runs}/{{model_id}}")
    async def get_run(model_id: str) -> dict[str, Any]:
        return await run_in_threadpool(checkpoint_routes.get_training_run, front, model_id)

    @app.get(f"{runs}/{{model_id}}/checkpoints")
    async def list_run_checkpoints(model_id: str) -> dict[str, Any]:
        return await run_in_threadpool(checkpoint_routes.list_checkpoints, front, model_id)

    @app.get(f"{API}/checkpoints")
    async def list_checkpoints(limit: str = "100", offset: str = "0") -> dict[str, Any]:
        route = checkpoint_routes.list_user_checkpoints
        return await run_in_threadpool(route, front, limit, offset)

    @app.delete(f"{runs}/{{model_id}}/checkpoints/{segment}")
    async def delete_checkpoint(model_id: str, kind: str, name: str) -> Response:
        route = checkpoint_routes.delete_checkpoint
        await run_in_threadpool(route, front, model_id, f"{kind}/{name}")
        return Response(status_code=204)

    @app.put(f"{runs}/{{model_id}}/checkpoints/{segment}/ttl")
    async def set_ttl(model_id: str, kind: str, name: str, request: Request) -> Response:
        data = await json_body(request)
        route = checkpoint_routes.set_checkpoint_ttl
        await run_in_threadpool(route, front, model_id, f"{kind}/{name}", data)
        return Response(status_code=204)

    @app.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        data = await json_body(request)
        return await run_in_threadpool(checkpoint_routes.weights_info, front, data)

    @app.get(f"{runs}/{{model_id}}/checkpoints/{segment}/external_weights_urls")
    async def weights_urls(model_id: str, kind: str, name: str, request: Request) -> Any:
        urls = external_weights.external_weights_urls
        base = str(request.base_url)
        return await run_in_threadpool(urls, front, model_id, f"{kind}/{name}", base)

    @app.get(f"{external_weights.DOWNLOAD_ROUTE}{{token}}")
    async def download(token: str) -> FileResponse:
        path = await run_in_threadpool(external_weights.signed_file, front, token)
        return FileResponse(path, media_type="application/octet-stream")

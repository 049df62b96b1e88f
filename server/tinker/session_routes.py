"""What this server knows of the SDK's sessions (``RestClient.list_sessions``, ``get_session``,
``search_sessions``, ``export_session_trace``), for the caller's own sessions only.

A session is known while the front keeps it (``SdkSessions``: created here, not yet forgotten)
or while the catalog keeps a training run it created (a run's id starts with its session's). What
is known of it: its training runs (the catalog's, with their checkpoints), the models it has
open, its sampling sessions, whether its client is still there (``active``) or closed it
(``client_finished``: the server is told that it finished, not why), and who owns it (its
tenant). What the hosted service keeps and this server does not is answered as absent rather
than made up: no display names, no session metadata, no projects (``assign_session_project`` is
refused with the reason). ``created_at`` is its first training run's creation, or, for a
session without one, when this process first listed it.

A trace export is built at once, as a Chrome trace-event JSON that Perfetto's UI opens (its runs
as spans from creation to their last request, each checkpoint an instant), handed back as a
``data:`` URL: ``urllib`` (which the SDK's docs download it with) reads one, and no second
credential or download route is needed.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound
from trainwire.server.tinker import saved_checkpoints
from trainwire.server.tinker.catalog import TrainingRunRecord, iso
from trainwire.server.tinker.checkpoint_routes import page_bounds
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.sampling_sessions import SAMPLER_NOTE
from trainwire.server.tinker.sdk_sessions import session_of
from trainwire.server.tinker.tenancy import tenant_of, visible

API = "/api/v1"
MAX_SEARCH_PAGE = 200  # the SDK's bound on a search page
STATUSES = ("active", "cancelled", "failed", "client_finished")
OWNERS = ("own", "accessible", "user")
BodyReader = Callable[[Request], Any]


@dataclass(frozen=True)
class SessionView:
    """One session as this server knows it."""

    session_id: str
    created_s: float
    status: str | None  # active, client_finished, or None (only its runs are known)
    runs: tuple[TrainingRunRecord, ...]
    open_models: tuple[str, ...]
    samplers: tuple[str, ...]

    @property
    def owner(self) -> str:
        return tenant_of(self.session_id)

    @property
    def checkpoints(self) -> int:
        return sum(len(run.checkpoints) for run in self.runs)

    @property
    def storage_bytes(self) -> int:
        return sum(c.size_bytes for run in self.runs for c in run.checkpoints.values())

    def status_body(self) -> dict[str, Any] | None:
        if self.status == "active":
            return {"type": "active"}
        return None  # closed: finished, but the server was not told why (no reason to give)

    def summary(self) -> dict[str, Any]:
        """The SDK's ``SessionSummary``."""
        return {
            "session_id": self.session_id,
            "created_at": iso(self.created_s),
            "owner": self.owner,
            "project_id": "",  # no projects on this server
            "status": self.status_body(),
            "checkpoints_count": self.checkpoints,
            "display_name": None,
            "user_metadata": None,
            "checkpoint_storage_bytes": self.storage_bytes,
        }

    def details(self) -> dict[str, Any]:
        """The SDK's ``GetSessionResponse`` (and, for a reader of the JSON, its status)."""
        return {
            "training_run_ids": sorted({*(r.model_id for r in self.runs), *self.open_models}),
            "sampler_ids": list(self.samplers),
            "user_metadata": None,
            "display_name": None,
            "status": self.status or "unknown",
            "open_model_ids": list(self.open_models),
        }

    def trace(self) -> dict[str, Any]:
        """A Chrome trace-event document of the session (times in microseconds)."""
        events: list[dict[str, Any]] = []
        for thread, run in enumerate(self.runs, 1):
            start, end = run.created_s * 1e6, max(run.last_request_s, run.created_s) * 1e6
            common = {"pid": 1, "tid": thread}
            events.append(
                {
                    **common,
                    "ph": "X",
                    "name": run.model_id,
                    "ts": start,
                    "dur": end - start,
                    "args": {"base_model": run.base_model},
                }
            )
            for saved in run.checkpoints.values():
                events.append(
                    {
                        **common,
                        "ph": "i",
                        "s": "t",
                        "name": saved.checkpoint_id,
                        "ts": saved.created_s * 1e6,
                        "args": {"size_bytes": saved.size_bytes},
                    }
                )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "metadata": {"session_id": self.session_id, "owner": self.owner},
        }


class SessionDirectory:
    """The caller's sessions, gathered from the front's parts at each call."""

    def __init__(self, front: TinkerFront, clock: Callable[[], float] = time.time) -> None:
        self.front = front
        self.clock = clock
        self._lock = threading.Lock()
        self._first_listed: dict[str, float] = {}  # sessions with no run: when first listed

    def all(self) -> list[SessionView]:
        """Every session the caller may see, newest first."""
        saved_checkpoints.sweep(self.front)
        runs: dict[str, list[TrainingRunRecord]] = {}
        for run in self.front.catalog.runs():
            runs.setdefault(session_of(run.model_id), []).append(run)
        known = self.front.models.sessions
        ids = {s for s in known if visible(s)} | set(runs)
        samplers = self._sampling_sessions_by_session()
        now = self.clock()
        with self._lock:
            self._first_listed = {s: self._first_listed.get(s, now) for s in ids if s not in runs}
            first_listed = dict(self._first_listed)
        views = []
        for session_id in ids:
            own_runs = sorted(runs.get(session_id, []), key=lambda r: r.created_s)
            created = own_runs[0].created_s if own_runs else first_listed[session_id]
            status = None
            if session_id in known:
                closed = known.silent_for(session_id) == float("inf")
                status = "client_finished" if closed else "active"
            models = tuple(m.model_id for m in self.front.models.models_of(session_id))
            views.append(
                SessionView(
                    session_id,
                    created,
                    status,
                    tuple(own_runs),
                    models,
                    tuple(sorted(samplers.get(session_id, []))),
                )
            )
        return sorted(views, key=lambda v: (v.created_s, v.session_id), reverse=True)

    def get(self, session_id: str) -> SessionView:
        """One of the caller's sessions; NotFound for one not known (or another tenant's)."""
        if visible(session_id):
            for view in self.all():
                if view.session_id == session_id:
                    return view
        raise NotFound(
            f"no session {session_id!r} on this server (never created here, or forgotten with "
            "no training run left in the catalog)"
        )

    def _sampling_sessions_by_session(self) -> dict[str, list[str]]:
        """The sampling sessions of the open model, by SDK session."""
        found: dict[str, list[str]] = {}
        for note in self.front.sampling_sessions.records():
            fields = getattr(note, "fields", {})
            if getattr(note, "kind", None) == SAMPLER_NOTE and not fields.get("named"):
                sampling_id = fields["sampling_session_id"]
                if visible(sampling_id):
                    found.setdefault(session_of(sampling_id), []).append(sampling_id)
        return found


# -- the routes' work ------------------------------------------------------------------------------


def list_sessions(directory: SessionDirectory, limit: Any, offset: Any) -> dict[str, Any]:
    limit_n, offset_n = page_bounds(limit, offset)
    views = directory.all()
    return {"sessions": [v.session_id for v in views[offset_n : offset_n + limit_n]]}


def search_sessions(directory: SessionDirectory, body: dict[str, Any]) -> dict[str, Any]:
    """The SDK's ``SessionSearchRequest``, over the caller's sessions, newest first."""
    match, limit, after = search_filter(body)
    found = [v for v in directory.all() if match(v)]
    if after is not None:
        found = [v for v in found if (v.created_s, v.session_id) < after]
    page = found[:limit]
    next_cursor = None
    if len(found) > limit:
        last = page[-1]
        next_cursor = {"last_created_at": iso(last.created_s), "last_session_id": last.session_id}
    return {"sessions": [v.summary() for v in page], "next_cursor": next_cursor}


def search_filter(
    body: dict[str, Any],
) -> tuple[Callable[[SessionView], bool], int, tuple[float, str] | None]:
    """A search request as a test of one session, its page size and where the page starts;
    InvalidArgument naming what cannot be searched here."""
    if body.get("project_ids") is not None:
        raise InvalidArgument(
            "search_sessions: project_ids: this server has no projects (its sessions belong to "
            "tenants, one per key); search without project_ids"
        )
    session_id, name = body.get("session_id"), body.get("display_name")
    metadata = body.get("user_metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidArgument("search_sessions: user_metadata is an object of strings")
    owner = body.get("owner") or {"type": "own"}
    if not isinstance(owner, dict) or owner.get("type") not in OWNERS:
        raise InvalidArgument(f"search_sessions: owner.type is one of {', '.join(OWNERS)}")
    owners = set(owner.get("owner_urns") or []) if owner["type"] == "user" else None
    statuses = _parse_statuses(body.get("statuses"))
    limit = body.get("limit", 50)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SEARCH_PAGE:
        raise InvalidArgument(f"search_sessions: limit is 1 to {MAX_SEARCH_PAGE}, got {limit!r}")

    def match(view: SessionView) -> bool:
        # No display names here: a name matches nothing, the id matches itself.
        if (session_id is not None or name is not None) and view.session_id != session_id:
            return False
        if metadata:  # sessions carry no metadata here
            return False
        if owners is not None and view.owner not in owners:
            return False
        return statuses is None or (view.status or "") in statuses

    return match, limit, _parse_cursor(body.get("cursor"))


def _parse_statuses(value: Any) -> set[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise InvalidArgument("search_sessions: statuses is a non-empty list, or null")
    kinds = {item.get("type") if isinstance(item, dict) else None for item in value}
    if not kinds <= set(STATUSES):
        raise InvalidArgument(f"search_sessions: a status is one of {', '.join(STATUSES)}")
    return {str(kind) for kind in kinds}


def _parse_cursor(value: Any) -> tuple[float, str] | None:
    if value is None:
        return None
    try:
        created = datetime.fromisoformat(str(value["last_created_at"])).timestamp()
        return created, str(value["last_session_id"])
    except (KeyError, TypeError, ValueError):
        raise InvalidArgument(
            "search_sessions: cursor is a response's next_cursor, passed back unchanged"
        ) from None


def trace_export(directory: SessionDirectory, session_id: str) -> dict[str, Any]:
    """The SDK's trace-export poll, answered ``ready`` at once."""
    document = json.dumps(directory.get(session_id).trace(), sort_keys=True).encode()
    url = "data:application/json;base64," + base64.b64encode(document).decode("ascii")
    return {"status": "ready", "url": url, "error": None}


def assign_project(directory: SessionDirectory, session_id: str) -> None:
    directory.get(session_id)  # someone else's, or none: 404 first
    raise FailedPrecondition(
        "assign_session_project: projects are a hosted-Tinker feature; this server has none "
        "(its sessions, runs and checkpoints belong to tenants, one per key)"
    )


def register(app: FastAPI, front: TinkerFront, body: BodyReader) -> None:
    """The session routes; ``body`` reads a route's JSON body (the app's reader)."""
    directory = SessionDirectory(front)
    sessions = f"{API}/sessions"

    @app.get(sessions)
    async def list_route(limit: str = "20", offset: str = "0") -> dict[str, Any]:
        return await run_in_threadpool(list_sessions, directory, limit, offset)

    @app.post(f"{sessions}/search")
    async def search_route(request: Request) -> dict[str, Any]:
        return await run_in_threadpool(search_sessions, directory, await body(request))

    @app.get(f"{sessions}/{{session_id}}")
    async def get_route(session_id: str) -> dict[str, Any]:
        view = await run_in_threadpool(directory.get, session_id)
        return view.details()

    @app.get(f"{sessions}/{{session_id}}/trace_export")
    async def trace_route(session_id: str) -> dict[str, Any]:
        return await run_in_threadpool(trace_export, directory, session_id)

    @app.put(f"{sessions}/{{session_id}}/project")
    async def project_route(session_id: str) -> None:
        await run_in_threadpool(assign_project, directory, session_id)

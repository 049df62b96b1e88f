"""Tenants on the Tinker front: every id the front hands out names its tenant, and a call sees
only the ids of its own.

An SDK session's id carries its tenant (``tw-<hex>.<tenant>``; ``default``'s is ``tw-<hex>``, the
id a server without tenants hands out), and every other id starts with the session that made it:
a model ``<session>:train:<n>``, a sampling session ``<session>:sample:<n>``, a request (a future)
``<model or sampling session>/<seq_id>``, a checkpoint ``tinker://<model>/<kind>/<name>`` and a
download URL, which signs that path. So who owns anything is read off its id (``tenant_of``):
nothing more to keep, nothing to lose at a restart, and whatever a server saved while it ran
without tenants is ``default``'s.

The caller is request-scoped: ``RequireKey`` sets it from the key (``calling``) for everything
the request runs, its worker threads included, and each lookup of an id (a session, the model,
a sampling session, a future, the catalog) asks ``visible``: another tenant's id is not found,
with the same answer as an id that does not exist. A sample the intake takes back after a
restart is decoded again as its sender's (``sender_of``); a stored call is queued again from its
typed record, as it was accepted, with nothing looked up again. A call that runs when its turn comes
was checked when it was accepted, and runs with no caller, which means no restriction; so does a
front without keys.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from trainwire.server.service.tenants import DEFAULT_TENANT
from trainwire.server.tinker.sdk_sessions import session_of

SESSION_PREFIX = "tw-"
TENANT_SEPARATOR = "."  # never in a tenant's name (``tenants.NAME_PATTERN``)
ID_FIELDS = ("model_id", "sampling_session_id", "session_id")  # what a request is sent under

_caller: ContextVar[str | None] = ContextVar("trainwire_tinker_caller", default=None)


def new_session_id(tenant: str | None) -> str:
    """A new SDK session's id, naming ``tenant`` (None or ``default``: no suffix)."""
    return session_id_named(uuid.uuid4().hex[:16], tenant)


def session_id_named(name: str, tenant: str | None) -> str:
    """The session id ``tw-<name>`` of ``tenant`` (None or ``default``: without a suffix)."""
    session_id = f"{SESSION_PREFIX}{name}"
    if tenant is None or tenant == DEFAULT_TENANT:
        return session_id
    return f"{session_id}{TENANT_SEPARATOR}{tenant}"


def tenant_of(identifier: str) -> str:
    """The tenant an id the front handed out belongs to (a session, model, sampling session or
    request id, or a tinker path's model id)."""
    session_id = session_of(identifier.rpartition("://")[2]).split("/", 1)[0]
    _, separator, tenant = session_id.partition(TENANT_SEPARATOR)
    return tenant if separator else DEFAULT_TENANT


def sender_of(body: Any) -> str | None:
    """The tenant a stored sample came from, by the first id its JSON body names (None: a
    body that names none)."""
    if isinstance(body, dict):
        for name in ID_FIELDS:
            value = body.get(name)
            if isinstance(value, str) and value:
                return tenant_of(value)
    return None


def caller() -> str | None:
    """The tenant of the request being answered (None: no key, or no request)."""
    return _caller.get()


def visible(identifier: str) -> bool:
    """Whether the caller may see the object ``identifier`` names (its tenant's, or no caller)."""
    who = _caller.get()
    return who is None or tenant_of(identifier) == who


@contextlib.contextmanager
def calling(tenant: str | None) -> Iterator[None]:
    """Answer a request of ``tenant``: lookups inside see only its ids."""
    token = _caller.set(tenant)
    try:
        yield
    finally:
        _caller.reset(token)


def unrestricted() -> contextlib.AbstractContextManager[None]:
    """The server's own work inside a request (removing every tenant's expired checkpoints)."""
    return calling(None)

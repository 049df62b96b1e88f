"""trainwire's server side, in folders by job: ``engine`` (TrainingSession, ManagedTraining),
``service`` (the session host and its operation table, journal, recovery), the two transports
``grpc`` and ``tinker``, and ``training`` (local runs through Lightning); ``process`` attaches
the transports to one host.

Importing the package stays light (no torch, no gRPC): ``TrainingSession``, ``ManagedTraining``
and ``SessionHost`` load on first use, and ``serve(...)`` imports the server process
(``trainwire.server.process``) when called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainwire.server.engine.managed import ManagedTraining
    from trainwire.server.engine.session.session import TrainingSession
    from trainwire.server.process import ServerHandle
    from trainwire.server.service.host import SessionHost

_LAZY = {
    "TrainingSession": "trainwire.server.engine.session.session",
    "ManagedTraining": "trainwire.server.engine.managed",
    "SessionHost": "trainwire.server.service.host",
}

__all__ = ["ManagedTraining", "SessionHost", "TrainingSession", "serve"]


def serve(*args: Any, **kwargs: Any) -> ServerHandle:
    """Start a trainwire server and return its handle (``.port``, ``.stop()``); the arguments are
    ``trainwire.server.process.serve``'s (``listen, state_dir, model_root=None, device=None,
    token=None``, then TLS, limits and interceptors by keyword)."""
    from trainwire.server.process import serve as start

    return start(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

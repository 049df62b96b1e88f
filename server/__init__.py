"""trainwire's server side: the training engine, its checkpoints, the journal and the servicer.

Importing the package stays light (no torch, no gRPC): ``TrainingSession``, ``ManagedTraining``
and ``SessionHost`` load on first use, and ``serve(...)`` imports the server when called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainwire.server.host import SessionHost
    from trainwire.server.managed import ManagedTraining
    from trainwire.server.serve import ServerHandle
    from trainwire.server.session import TrainingSession

_LAZY = {
    "TrainingSession": "trainwire.server.session",
    "ManagedTraining": "trainwire.server.managed",
    "SessionHost": "trainwire.server.host",
}

__all__ = ["ManagedTraining", "SessionHost", "TrainingSession", "serve"]


def serve(*args: Any, **kwargs: Any) -> ServerHandle:
    """Start a trainwire server; see ``trainwire.server.serve.serve`` for the arguments."""
    from trainwire.server.serve import serve as start

    return start(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

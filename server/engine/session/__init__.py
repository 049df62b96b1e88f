"""The training session: ``TrainingSession`` (``session``) and the state it keeps: what it checks
before it allocates (``setup``), its operation guard and RNG, its state digest, its checkpoint
format (``checkpoint``, read back by ``restore``) and the results its operations return.

``from trainwire.server.engine.session import TrainingSession`` loads the session on first use:
the modules below it (the checkpoint format, the RNG, the digest) are imported by the weights and
sharded code that the session itself imports, so this package must not import the session eagerly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainwire.server.engine.loss.loss_hook import LossHook
    from trainwire.server.engine.session.results import ForwardResult, StepResult, TokenOutput
    from trainwire.server.engine.session.session import TrainingSession

_LAZY = {
    "TrainingSession": "trainwire.server.engine.session.session",
    "LossHook": "trainwire.server.engine.loss.loss_hook",
    "ForwardResult": "trainwire.server.engine.session.results",
    "StepResult": "trainwire.server.engine.session.results",
    "TokenOutput": "trainwire.server.engine.session.results",
}

__all__ = ["ForwardResult", "LossHook", "StepResult", "TokenOutput", "TrainingSession"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

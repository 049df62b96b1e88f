"""The Tinker front's parts, as the routes see them: the session host, the sequencer and the
model slot (``startup`` builds them and reads the request log back).

The front owns no engine and no state directory of its own: it reaches the session only through
the host's operation table and lifecycle (``open``, ``close``, ``recover``), keeps its own files
in ``directory`` (``tinker/`` in the state directory), and is told the model root by the process
that starts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainwire.server.service.host import SessionHost
from trainwire.server.tinker.model_slot import ModelSlot
from trainwire.server.tinker.sampling_sessions import SamplingSessions
from trainwire.server.tinker.sequencer import Sequencer

FRONT_DIR = "tinker"  # the front's own files, beside the runs in the state directory


@dataclass(frozen=True)
class TinkerFront:
    """One server's SDK front: ``host`` runs the operations, ``sequencer`` orders, logs and
    answers the calls, ``models`` says which run the SDK's model is."""

    host: SessionHost
    sequencer: Sequencer
    models: ModelSlot
    directory: Path
    model_root: Path | None

    @property
    def sampling_sessions(self) -> SamplingSessions:
        """The sampling sessions of the model now in the slot (they end with it)."""
        return self.models.sampling_sessions

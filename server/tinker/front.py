"""The Tinker front's parts, as the routes see them: the session host, the service's intake and
the model table (``startup`` builds them and reads the request store back).

The front owns no engine and no state directory of its own: it reaches the session only through
the host's operation table and lifecycle (``open``, ``close``, ``recover``), keeps its own files
in ``directory`` (``tinker/`` in the state directory), and is told the model root by the process
that starts it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainwire.server.service.host import SessionHost
from trainwire.server.service.intake import Intake, Submission
from trainwire.server.service.request_records import Body
from trainwire.server.tinker.catalog import Catalog
from trainwire.server.tinker.model_table import ModelTable
from trainwire.server.tinker.sampling_sessions import SamplingSessions

FRONT_DIR = "tinker"  # the front's own files, beside the runs in the state directory


@dataclass(frozen=True)
class TinkerFront:
    """One server's SDK front: ``host`` runs the operations, ``intake`` orders, records and
    answers the calls, ``models`` says which run the SDK's model is, ``catalog`` what every run
    saved under a name."""

    host: SessionHost
    intake: Intake
    models: ModelTable
    directory: Path
    model_root: Path | None
    catalog: Catalog  # every run's named checkpoints, kept after the run closes

    @property
    def sampling_sessions(self) -> SamplingSessions:
        """The sampling sessions (those of a model's snapshots end with it)."""
        return self.models.sampling_sessions

    def submit(
        self,
        body: Body,
        model_id: str,
        seq_id: Any,
        prepare: Callable[[], Submission],
        **options: Any,
    ) -> str:
        """Queue a training call of ``model_id`` (``Intake.submit``), bound to the run it was
        sent to: when its turn comes the host runs it only while that run is open, so a call
        queued before its model closed never runs on another model's run."""
        run_id = self.models.require_model(model_id).run_id

        def bound() -> Submission:
            return replace(prepare(), run_id=run_id)

        return self.intake.submit(body, model_id, seq_id, bound, **options)

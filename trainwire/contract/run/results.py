"""What a finished run reports, the same for in-process, remote and Lightning runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainingResult:
    """The outcome of a managed run.

    The first seven fields are the seed's ``TrainingResult``, in its order, so code written
    against it (positionally or by name) runs unchanged; the rest have defaults.

    Attributes:
        best_checkpoint_path: the checkpoint holding the best weights: the earliest evaluation
            with the best ``metric_for_best`` (None without evaluation).
        last_checkpoint_path: the checkpoint written at the end of the run (None where the
            runner keeps none on this side, as the remote controller).
        config_path: the file the run's config was read from (the manifest), where known.
        best_score: the best value of ``metric_for_best`` on the eval examples (a held-out
            figure, not an in-sample loss), or None without evaluation.
        stopped_epoch: the plan epoch of the last update applied.
        early_stopped: True when early stopping ended the run before the plan did.
        metrics: the final figures (train loss of the last update, last evaluation, ...).
        best_step, best_epoch: where the best evaluation happened.
        stopped_step: the last update applied.
        history: one record per update and per evaluation, in order
            (``trainwire.contract.run.history``).
        state_digest: the session's digest at the end of the run.
    """

    best_checkpoint_path: str | None = None
    last_checkpoint_path: str | None = None
    config_path: str | None = None
    best_score: float | None = None
    stopped_epoch: int = 0
    early_stopped: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    best_step: int | None = None
    best_epoch: int | None = None
    stopped_step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    state_digest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

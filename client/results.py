"""What a finished run reports, the same for in-process, remote and Lightning runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainingResult:
    """The outcome of a managed run.

    Attributes:
        best_score: the best value of the selection metric, or None without evaluation.
        best_step, best_epoch: where the best evaluation happened.
        best_checkpoint: the checkpoint holding the best weights (None without evaluation).
        last_checkpoint: the checkpoint written at the end of the run.
        stopped_step, stopped_epoch: the last update applied and its epoch.
        early_stopped: True when early stopping ended the run before the plan did.
        history: one record per update and per evaluation, in order.
        metrics: the final figures (train loss of the last update, last evaluation, ...).
        state_digest: the session's digest at the end of the run.
    """

    best_score: float | None = None
    best_step: int | None = None
    best_epoch: int | None = None
    best_checkpoint: str | None = None
    last_checkpoint: str | None = None
    stopped_step: int = 0
    stopped_epoch: int = 0
    early_stopped: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    state_digest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

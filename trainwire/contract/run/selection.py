"""Best selection and early stopping, shared by every runner so they decide identically.

The best is the earliest evaluation with the best metric: a later equal value is no gain, and
it counts against the patience of early stopping (``min_delta`` is 0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

BEST_CHECKPOINT = "best"
"""The name the best weights are kept under (a checkpoint, locally or on the server), which
checkpoint retention never removes."""


@dataclass
class SelectionState:
    """Where selection stands after the evaluations seen so far."""

    metric: str
    mode: str  # "min" or "max"
    patience: int | None  # None: never stop early
    best_value: float | None = None
    best_step: int | None = None
    best_epoch: int | None = None
    evaluations_without_gain: int = 0
    stopped_early: bool = False

    @classmethod
    def from_policy(cls, policy: dict[str, Any]) -> SelectionState:
        return cls(metric=policy["metric"], mode=policy["mode"], patience=policy["patience"])

    def is_gain(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value > self.best_value if self.mode == "max" else value < self.best_value

    def observe(self, metrics: dict[str, float], *, step: int, epoch: int) -> bool:
        """Record one evaluation; True when it is the new best."""
        value = metrics[self.metric]
        if self.is_gain(value):
            self.best_value, self.best_step, self.best_epoch = value, step, epoch
            self.evaluations_without_gain = 0
            return True
        self.evaluations_without_gain += 1
        if self.patience is not None and self.evaluations_without_gain >= self.patience:
            self.stopped_early = True
        return False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SelectionState:
        return cls(**data)

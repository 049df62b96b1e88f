"""A run's history: one record per update and per evaluation, built by these functions only.

Every runner (in-process, remote, Lightning) goes through ``trainwire.contract.run.replay``, which
builds its records here, so equal runs have equal histories, key for key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

UPDATE = "update"
EVALUATION = "evaluation"
# Where a record falls, the first keys of both kinds; the rest are what it measured.
_WHERE = ("kind", "microbatch", "epoch", "step")


def update_record(
    *,
    microbatch: int,
    epoch: int,
    step: int,
    losses: Sequence[float],
    learning_rate: float,
    grad_norm: float,
) -> dict[str, Any]:
    """The history record of one update; its loss is the mean of its microbatches' losses."""
    loss = sum(losses) / len(losses)
    figures = {"loss": loss, "learning_rate": learning_rate, "grad_norm": grad_norm}
    return _record(UPDATE, microbatch, epoch, step, figures)


def evaluation_record(
    *, microbatch: int, epoch: int, step: int, metrics: dict[str, float], is_best: bool
) -> dict[str, Any]:
    """The history record of one evaluation: its metrics and whether it became the best."""
    return _record(EVALUATION, microbatch, epoch, step, {**metrics, "is_best": is_best})


def record_figures(record: dict[str, Any]) -> dict[str, float]:
    """What a record measured (loss, learning rate, gradient norm, an evaluation's metrics),
    without where it falls (kind, microbatch, epoch, step) or the ``is_best`` verdict."""
    return {
        name: value
        for name, value in record.items()
        if name not in _WHERE and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _record(
    kind: str, microbatch: int, epoch: int, step: int, fields: dict[str, Any]
) -> dict[str, Any]:
    # Where the record falls comes first, in the same keys for both kinds.
    return dict(zip(_WHERE, (kind, microbatch, epoch, step), strict=True), **fields)

"""A run's history: one record per update and per evaluation, built by these functions only.

Every runner (in-process, remote, Lightning) goes through ``trainwire.contract.run.replay``, which
builds its records here, so equal runs have equal histories, key for key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

UPDATE = "update"
EVALUATION = "evaluation"


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


def _record(
    kind: str, microbatch: int, epoch: int, step: int, fields: dict[str, Any]
) -> dict[str, Any]:
    # Where the record falls comes first, in the same keys for both kinds.
    return {"kind": kind, "microbatch": microbatch, "epoch": epoch, "step": step, **fields}

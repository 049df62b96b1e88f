"""What a run reports as it goes: per-update and per-evaluation history records, and the
progress event handed to ``on_step`` callbacks. Every runner builds them with these functions,
so in-process, remote and Lightning runs produce equal histories."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Progress:
    """One microbatch done: where the run stands."""

    microbatch: int  # the index just completed
    batch_count: int
    epoch: int
    step: int  # updates applied so far
    max_steps: int
    loss: float  # this microbatch's loss
    update: dict[str, Any] | None = None  # the update record, when one followed
    evaluation: dict[str, Any] | None = None  # the evaluation record, when one followed
    tokens: int = 0  # tokens in this microbatch, where known
    extra: dict[str, Any] = field(default_factory=dict)


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
    return {
        "kind": "update",
        "microbatch": microbatch,
        "epoch": epoch,
        "step": step,
        "loss": sum(losses) / len(losses),
        "learning_rate": learning_rate,
        "grad_norm": grad_norm,
    }


def evaluation_record(
    *, microbatch: int, epoch: int, step: int, metrics: dict[str, float], is_best: bool
) -> dict[str, Any]:
    return {
        "kind": "evaluation",
        "microbatch": microbatch,
        "epoch": epoch,
        "step": step,
        **metrics,
        "is_best": is_best,
    }

"""Small plans the tests share, and the one way tests drive a plan op by op
(import ``from plans import ...``).

The config factories the plans take come from conftest.py (``bert_classifier_config``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainwire.client import ManagedTrainingPlan
from trainwire.contract.run.evaluation import EvaluationTally, evaluation_batches
from trainwire.contract.run.selection import SelectionState
from trainwire.testing import tiny_sentiment_examples


def sentiment_plan(
    config_factory: Callable[..., Any], *, examples: int = 23, **changes: Any
) -> ManagedTrainingPlan:
    """Sentiment classification with epoch evaluation and accuracy selection.

    By default: 23 examples in microbatches of 5 (a partial last one), updates after every 2
    microbatches and at each epoch end (a partial accumulation), 3 epochs.
    """
    settings = {
        "learning_rate": 5e-3,
        "batch_size": 5,
        "gradient_accumulation_steps": 2,
        "num_epochs": 3,
        "eval_strategy": "epoch",
        "metric_for_best": "eval_accuracy",
        **changes,
    }
    return ManagedTrainingPlan(
        tiny_sentiment_examples(examples),
        config_factory(**settings),
        eval_examples=tiny_sentiment_examples(8, seed=1),
    )


def drive_plan(
    session: Any,
    plan: ManagedTrainingPlan,
    start: int = 0,
    stop: int | None = None,
    *,
    after_op: Callable[[int, str], None] | None = None,
    evaluate: bool = False,
) -> list[float]:
    """Run microbatches ``start..stop-1`` on ``session`` as every runner does; their losses.

    This is the reference the runners (ManagedTraining, the Controller, ``trainwire train``) must
    equal, written as plainly as possible: ``forward_backward`` on each microbatch, then
    ``optim_step`` iff the plan updates there. ``after_op(i, "forward_backward" | "optim_step")``
    is called after each operation. With ``evaluate``, the plan's evaluations run where it
    evaluates, the best is selected by its policy, and the run ends where it stops early.
    """
    selection = SelectionState.from_policy(plan.selection_policy)
    losses = []
    for i in range(start, plan.batch_count if stop is None else stop):
        losses.append(session.forward_backward(plan.batch(i)))
        if after_op is not None:
            after_op(i, "forward_backward")
        if plan.is_update(i):
            session.optim_step()
            if after_op is not None:
                after_op(i, "optim_step")
        if evaluate and plan.evaluates_after(i):
            tally = EvaluationTally()
            for batch in evaluation_batches(plan.eval_examples, plan.config.batch_size):
                result = session.forward(batch)
                tally.add(batch, result.loss, [p.label for p in result.predictions])
            selection.observe(tally.metrics(), step=session.step, epoch=plan.epoch(i))
            if selection.stopped_early:
                break
    return losses

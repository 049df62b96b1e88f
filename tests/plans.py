"""Small plans the managed, controller and chaos tests share (import ``from plans import ...``).

The config factories they take come from conftest.py (``bert_classifier_config``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainwire.client import ManagedTrainingPlan
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

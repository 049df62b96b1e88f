"""Helpers the Lightning tests share: small plans, real short ``trainwire train`` runs, the
op-by-op replay they must equal, a callback that interrupts a run, and file snapshots.

Import what a test module needs (``from training_runs import ...``); the tiny models and config
factories come from conftest.py. Runs made by :func:`shared_run` are built once per test session
and must be treated as read-only: the tests that use them only do what must change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from plans import drive_plan

from trainwire.client import ManagedTrainingPlan, write_plan_manifest
from trainwire.contract.run.results import TrainingResult
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession
from trainwire.server.training.run import train
from trainwire.testing import tiny_sentiment_examples, tiny_text_examples

REVIEWS = tiny_sentiment_examples(10)
EVAL_REVIEWS = tiny_sentiment_examples(4, seed=1)
TEXTS = tiny_text_examples(7)
EVAL_TEXTS = tiny_text_examples(3, seed=1)


def classifier_plan(config: Callable[..., Any], **changes: Any) -> ManagedTrainingPlan:
    """Full-weights bert: 5 microbatches an epoch, updates after 2, 4 and 5, 2 epochs."""
    settings = {
        "batch_size": 2,
        "gradient_accumulation_steps": 2,
        "num_epochs": 2,
        "eval_strategy": "epoch",
        **changes,
    }
    return ManagedTrainingPlan(REVIEWS, config(**settings), eval_examples=EVAL_REVIEWS)


def lora_plan(config: Callable[..., Any], lora: Any, **changes: Any) -> ManagedTrainingPlan:
    """A LoRA llama (dropout, so the session's RNG takes part), 3 microbatches an epoch."""
    settings = {
        "lora": lora,
        "batch_size": 3,
        "gradient_accumulation_steps": 2,
        "num_epochs": 2,
        "eval_strategy": "epoch",
        **changes,
    }
    return ManagedTrainingPlan(TEXTS, config(**settings), eval_examples=EVAL_TEXTS)


def stopping_plan(config: Callable[..., Any]) -> ManagedTrainingPlan:
    """A run early stopping ends after its second of three epochs: with learning rate 0 the
    evaluation ties, and a tie is no gain."""
    settings = {
        "batch_size": 5,
        "num_epochs": 3,
        "learning_rate": 0.0,
        "eval_strategy": "epoch",
        "early_stopping": True,
        "early_stopping_patience": 1,
    }
    return ManagedTrainingPlan(REVIEWS, config(**settings), eval_examples=EVAL_REVIEWS)


def write_manifest(directory: Path, plan: ManagedTrainingPlan) -> Path:
    path = directory / "manifest.json"
    write_plan_manifest(path, plan)
    return path


def op_by_op(plan: ManagedTrainingPlan) -> str:
    """The plan driven op by op on a TrainingSession (:func:`plans.drive_plan` with evaluation,
    selection and early stopping); its final digest."""
    session = TrainingSession(plan.config, device="cpu", max_steps=plan.max_steps)
    drive_plan(session, plan, evaluate=True)
    return session.state_digest()


def managed(plan: ManagedTrainingPlan) -> TrainingResult:
    """The same plan through ManagedTraining, the in-process replay the controller shares."""
    training = ManagedTraining(
        TrainingSession(plan.config, device="cpu", max_steps=plan.max_steps), plan
    )
    try:
        return training.run()
    finally:
        training.close()


_REFERENCES: dict[str, tuple[str, TrainingResult]] = {}


def references(plan: ManagedTrainingPlan) -> tuple[str, TrainingResult]:
    """``(op_by_op(plan), managed(plan))``, computed once per plan."""
    if plan.fingerprint not in _REFERENCES:
        _REFERENCES[plan.fingerprint] = (op_by_op(plan), managed(plan))
    return _REFERENCES[plan.fingerprint]


class StopAfter(pl.Callback):
    """Asks the trainer to stop after ``count`` microbatches, as an interrupted run would."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen += 1
        if self.seen == self.count:
            trainer.should_stop = True


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory``: file bytes, None for directories."""
    return {
        str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
        for path in sorted(directory.rglob("*"))
    }


@dataclass
class Run:
    manifest: Path
    output: Path
    plan: ManagedTrainingPlan
    result: TrainingResult


def last_checkpoint(run: Run) -> Path:
    """The run's ``last.ckpt``."""
    return run.output / "checkpoints" / "last.ckpt"


_RUNS: dict[str, Run] = {}


def shared_run(tmp_path_factory: pytest.TempPathFactory, plan: ManagedTrainingPlan) -> Run:
    """A finished ``trainwire train`` run of ``plan``, built once per test session.

    Keyed by the plan's fingerprint, so two modules asking for the same plan share one run and
    two different plans never meet under one key.
    """
    if plan.fingerprint not in _RUNS:
        directory = tmp_path_factory.mktemp("run")
        manifest = write_manifest(directory, plan)
        output = directory / "out"
        _RUNS[plan.fingerprint] = Run(manifest, output, plan, train(manifest, output, device="cpu"))
    return _RUNS[plan.fingerprint]

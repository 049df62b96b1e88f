"""The one loop that replays a plan: microbatches, updates, evaluations, best selection, early
stopping.

``run_microbatch`` runs one microbatch of the plan and takes every decision that follows it;
``replay`` calls it until the run ends. In-process runs (ManagedTraining), remote runs (the
Controller) and local Lightning runs (``trainwire train``: its module calls ``run_microbatch``
from ``training_step``) each supply a small ``ReplayBackend``, so they take the same decisions
in the same order and end with the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainwire.contract.config import InputExample
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.run.evaluation import EvaluationTally, evaluation_batches
from trainwire.contract.run.history import UPDATE, evaluation_record, update_record
from trainwire.contract.run.progress import Progress
from trainwire.contract.run.results import TrainingResult
from trainwire.contract.run.selection import SelectionState


@dataclass
class RunState:
    """Where a replay stands: enough to resume it exactly, JSON round-trippable."""

    plan_fingerprint: str
    selection: SelectionState
    next_microbatch: int = 0
    pending_losses: list[float] = field(default_factory=list)  # since the last update
    history: list[dict[str, Any]] = field(default_factory=list)
    best_checkpoint: str | None = None
    finished: bool = False
    # A microbatch whose closing step (after_microbatch) had not run when this state was saved:
    # the best's checkpoint is taken before it, so a run resumed from there runs it first.
    after_pending: int | None = None

    @classmethod
    def start(cls, plan: ManagedTrainingPlan) -> RunState:
        return cls(plan.fingerprint, SelectionState.from_policy(plan.selection_policy))

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan_fingerprint": self.plan_fingerprint,
            "selection": self.selection.to_dict(),
            "next_microbatch": self.next_microbatch,
            "pending_losses": list(self.pending_losses),
            "history": list(self.history),
            "best_checkpoint": self.best_checkpoint,
            "finished": self.finished,
            "after_pending": self.after_pending,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        return cls(
            plan_fingerprint=data["plan_fingerprint"],
            selection=SelectionState.from_dict(data["selection"]),
            next_microbatch=data["next_microbatch"],
            pending_losses=list(data["pending_losses"]),
            history=list(data["history"]),
            best_checkpoint=data["best_checkpoint"],
            finished=data["finished"],
            after_pending=data.get("after_pending"),
        )


@dataclass
class StepOutcome:
    """What an update reports: the updates applied so far, the rate used, the gradient norm."""

    step: int
    learning_rate: float
    grad_norm: float


class ReplayBackend(Protocol):
    """The operations a replay needs; microbatch indices let a remote backend key them."""

    def forward_backward(self, index: int, examples: list[InputExample]) -> tuple[float, int]:
        """The microbatch's loss and its (non-padding) token count."""
        ...

    def optim_step(self, index: int) -> StepOutcome: ...

    def forward(self, examples: list[InputExample]) -> tuple[float, list[str]]:
        """The batch loss and, for classification, the predicted labels."""
        ...

    def save_best(self, index: int, state: RunState) -> None:
        """Keep the current weights as the best, and name them in ``state.best_checkpoint``.

        The name goes into ``state`` before anything is persisted, so a checkpoint or snapshot
        taken here already records where the best lives.
        """
        ...

    def after_microbatch(self, index: int, state: RunState) -> None:
        """Microbatch ``index`` and what follows it are done: persist, checkpoint, report."""
        ...


def evaluate(
    backend: ReplayBackend, examples: Sequence[InputExample], batch_size: int
) -> dict[str, float]:
    """The metrics of the current weights on ``examples``, in the training batch size."""
    tally = EvaluationTally()
    for batch in evaluation_batches(examples, batch_size):
        loss, labels = backend.forward(batch)
        tally.add(batch, loss, labels)
    return tally.metrics()


def checkpoint_due(plan: ManagedTrainingPlan, index: int, every: int | None) -> bool:
    """Whether a periodic checkpoint follows microbatch ``index``: after every ``every``-th
    update (None or 0: never)."""
    return bool(every) and plan.is_update(index) and plan.steps_after(index) % every == 0


def run_microbatch(
    plan: ManagedTrainingPlan,
    backend: ReplayBackend,
    state: RunState,
    *,
    eval_examples: Sequence[InputExample] | None = None,
) -> Progress:
    """Run the plan's next microbatch (``state.next_microbatch``) and everything it decides.

    In order: forward_backward; the update iff the plan updates there; evaluation and best
    selection where it evaluates; whether the run is finished (plan spent or early stop); the
    best's checkpoint; then ``backend.after_microbatch`` (persist, checkpoint, report). Every
    runner calls this one function, so all take the same decisions in the same order.
    """
    i = state.next_microbatch
    if state.finished or not 0 <= i < plan.batch_count:
        raise RuntimeError(
            f"no microbatch to run: the run is at {i} of {plan.batch_count}"
            + (" and finished" if state.finished else "")
        )
    eval_examples = plan.eval_examples if eval_examples is None else eval_examples
    epoch, step = plan.epoch(i), plan.steps_after(i)
    loss, tokens = backend.forward_backward(i, plan.batch(i))
    state.pending_losses.append(loss)
    update = evaluation = None
    if plan.is_update(i):
        outcome = backend.optim_step(i)
        update = update_record(
            microbatch=i,
            epoch=epoch,
            step=outcome.step,
            losses=state.pending_losses,
            learning_rate=outcome.learning_rate,
            grad_norm=outcome.grad_norm,
        )
        state.history.append(update)
        state.pending_losses = []
    state.next_microbatch = i + 1
    if plan.evaluates_after(i):
        metrics = evaluate(backend, eval_examples or (), plan.config.batch_size)
        is_best = state.selection.observe(metrics, step=step, epoch=epoch)
        evaluation = evaluation_record(
            microbatch=i, epoch=epoch, step=step, metrics=metrics, is_best=is_best
        )
        state.history.append(evaluation)
    # Early stopping ends the run here: the last microbatch run is its last.
    state.finished = state.selection.stopped_early or i + 1 == plan.batch_count
    if evaluation is not None and evaluation["is_best"]:
        state.after_pending = i
        backend.save_best(i, state)
        state.after_pending = None
    backend.after_microbatch(i, state)
    return Progress(
        microbatch=i,
        batch_count=plan.batch_count,
        epoch=epoch,
        step=step,
        max_steps=plan.max_steps,
        loss=loss,
        update=update,
        evaluation=evaluation,
        tokens=tokens,
    )


def replay(
    plan: ManagedTrainingPlan,
    backend: ReplayBackend,
    state: RunState,
    *,
    eval_examples: Sequence[InputExample] | None = None,
    on_step: Callable[[Progress], None] | None = None,
) -> RunState:
    """Run the plan from ``state.next_microbatch`` to its end or to an early stop."""
    if state.after_pending is not None:
        # Saved while the best's checkpoint was taken: that microbatch's closing step first.
        pending, state.after_pending = state.after_pending, None
        backend.after_microbatch(pending, state)
    while not state.finished and state.next_microbatch < plan.batch_count:
        progress = run_microbatch(plan, backend, state, eval_examples=eval_examples)
        if on_step is not None:
            on_step(progress)
    return state


def training_result(
    plan: ManagedTrainingPlan,
    state: RunState,
    *,
    state_digest: str,
    last_checkpoint_path: str | None,
    config_path: str | None = None,
) -> TrainingResult:
    """The result of a finished replay, the same for every runner."""
    last = max(state.next_microbatch - 1, 0)
    selection = state.selection
    metrics: dict[str, float] = {}
    for record in state.history:
        if record["kind"] == UPDATE:
            metrics["train_loss"] = record["loss"]
        else:
            metrics.update({k: v for k, v in record.items() if k.startswith("eval_")})
    return TrainingResult(
        best_checkpoint_path=state.best_checkpoint,
        last_checkpoint_path=last_checkpoint_path,
        config_path=config_path,
        best_score=selection.best_value,
        stopped_epoch=plan.epoch(last),
        early_stopped=selection.stopped_early,
        metrics=metrics,
        best_step=selection.best_step,
        best_epoch=selection.best_epoch,
        stopped_step=plan.steps_after(last) if state.next_microbatch else 0,
        history=list(state.history),
        state_digest=state_digest,
    )

"""ManagedTraining: a plan replayed in-process on a TrainingSession.

It drives the same replay loop as the remote Controller (``trainwire.contract.run.replay``), so the
two take the same decisions and end with the same bits. Managed checkpoints are session
checkpoints whose ``extra`` holds the run state: plan fingerprint, exact cursor, evaluation and
best state, history and early-stopping counters.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from trainwire.contract.config import InputExample
from trainwire.contract.planning.plan import ManagedTrainingPlan, check_examples
from trainwire.contract.run.progress import Progress
from trainwire.contract.run.replay import (
    RunState,
    StepOutcome,
    checkpoint_due,
    replay,
    training_result,
)
from trainwire.contract.run.results import TrainingResult
from trainwire.contract.run.selection import BEST_CHECKPOINT
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import FailedPrecondition, InvalidArgument

MANAGED_KEY = "managed"
LAST_CHECKPOINT = "last"


def save_managed_checkpoint(session: TrainingSession, path: str | Path, state: RunState) -> None:
    """A managed checkpoint: the session's complete state, with ``state`` in its extra."""
    session.save_state(Path(path), extra={MANAGED_KEY: state.to_dict()})


class SessionBackend:
    """The replay's operations, applied directly to a local session.

    It checkpoints into ``checkpoint_dir``: the best at every new best, ``last`` every
    ``checkpoint_every`` updates (never when None).
    """

    def __init__(
        self,
        session: TrainingSession,
        plan: ManagedTrainingPlan,
        checkpoint_dir: Path,
        checkpoint_every: int | None,
    ) -> None:
        self.session = session
        self.plan = plan
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every

    def forward_backward(self, index: int, examples: list[InputExample]) -> tuple[float, int]:
        loss = self.session.forward_backward(examples)
        return loss, self.session.last_token_count

    def optim_step(self, index: int) -> StepOutcome:
        result = self.session.optim_step()
        return StepOutcome(result.step, result.learning_rate, result.grad_norm)

    def forward(self, examples: list[InputExample]) -> tuple[float, list[str]]:
        result = self.session.forward(examples)
        return result.loss, [prediction.label for prediction in result.predictions]

    def save_best(self, index: int, state: RunState) -> None:
        path = self.checkpoint_dir / BEST_CHECKPOINT
        state.best_checkpoint = str(path)
        save_managed_checkpoint(self.session, path, state)

    def after_microbatch(self, index: int, state: RunState) -> None:
        if checkpoint_due(self.plan, index, self.checkpoint_every):
            save_managed_checkpoint(self.session, self.checkpoint_dir / LAST_CHECKPOINT, state)


class ManagedTraining:
    """Replays ``plan`` on ``session``: run, checkpoint, resume, export the best, close.

    The session must be built for this plan: the same config and ``max_steps=plan.max_steps``
    (the schedule decays over it). ``checkpoint_dir`` holds the best and last checkpoints (a
    temporary directory, removed on close, when not given); ``checkpoint_every`` saves ``last``
    every that many updates.
    """

    def __init__(
        self,
        session: TrainingSession,
        plan: ManagedTrainingPlan,
        eval_examples: Sequence[InputExample] | None = None,
        *,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
    ) -> None:
        if session.config.fingerprint() != plan.config.fingerprint():
            raise InvalidArgument(
                "the session's config is not the plan's: session "
                f"{session.config.fingerprint()}, plan {plan.config.fingerprint()}"
            )
        if session.max_steps != plan.max_steps:
            raise InvalidArgument(
                f"the session was built with max_steps={session.max_steps}, the plan has "
                f"{plan.max_steps} updates; build it with max_steps=plan.max_steps"
            )
        if checkpoint_every is not None and checkpoint_every < 1:
            raise InvalidArgument(f"checkpoint_every must be positive, got {checkpoint_every}")
        if eval_examples is not None:
            eval_examples = list(eval_examples)
            check_examples(eval_examples, plan.config, what="eval example")
        self.session = session
        self.plan = plan
        self.eval_examples = eval_examples if eval_examples is not None else plan.eval_examples
        if plan.config.eval_strategy != "no" and not self.eval_examples:
            raise InvalidArgument("the plan evaluates, but there are no eval examples")
        self._owns_checkpoint_dir = checkpoint_dir is None
        self.checkpoint_dir = Path(checkpoint_dir or tempfile.mkdtemp(prefix="trainwire-run-"))
        self.checkpoint_every = checkpoint_every
        self.state = RunState.start(plan)

    def run(self, on_step: Callable[[Progress], None] | None = None) -> TrainingResult:
        """Run to the end of the plan (or an early stop) from wherever the run stands."""
        backend = SessionBackend(
            self.session, self.plan, self.checkpoint_dir, self.checkpoint_every
        )
        self.state = replay(
            self.plan, backend, self.state, eval_examples=self.eval_examples, on_step=on_step
        )
        last = self.checkpoint_dir / LAST_CHECKPOINT
        save_managed_checkpoint(self.session, last, self.state)
        return training_result(
            self.plan,
            self.state,
            state_digest=self.session.state_digest(),
            last_checkpoint_path=str(last),
        )

    def save_state(self, path: str | Path) -> None:
        """A managed checkpoint: the session's complete state plus the run's cursor."""
        save_managed_checkpoint(self.session, path, self.state)

    def load_state(self, path: str | Path) -> None:
        """Resume from a managed checkpoint into this run's fresh session."""
        from trainwire.server.engine.session.checkpoint import read_extra

        saved = read_extra(Path(path)).get(MANAGED_KEY)
        if saved is None:
            raise InvalidArgument(f"{path} is a session checkpoint without a managed run state")
        try:
            state = RunState.from_dict(saved)
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidArgument(f"{path}: malformed managed run state ({error!r})") from None
        if state.plan_fingerprint != self.plan.fingerprint:
            raise FailedPrecondition(
                f"the checkpoint belongs to plan {state.plan_fingerprint}, this run's plan is "
                f"{self.plan.fingerprint}; resume it with its own manifest"
            )
        self.session.load_state(path)
        self.state = state

    def export_weights(self, path: str | Path) -> None:
        """Export the best weights (from a detached CPU copy) or, without evaluation, the last."""
        best = self.state.best_checkpoint
        if best is not None:
            self.session.export_checkpoint_weights(best, path)
        else:
            self.session.export_weights(path)

    def close(self) -> None:
        """Remove the temporary checkpoint directory, if this run made one."""
        if self._owns_checkpoint_dir:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)

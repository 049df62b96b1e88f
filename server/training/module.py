"""The LightningModule that drives the one engine through a manifest's microbatches.

The engine does the math (``TrainingSession``: forward_backward, optim_step, forward) and the
replay's ``run_microbatch`` takes the decisions, exactly as for every other runner; Lightning
provides the loop, the callbacks, checkpoints and logging. One ``training_step`` is one
microbatch of the plan, offered by a DataLoader over microbatch indices, so the loop, the plan
and the logs share one index.

A Lightning epoch here is a *segment* of the plan: it ends after every evaluation and every plan
epoch end. Callbacks judge at Lightning epoch ends, so each evaluation is judged once, and every
checkpoint is written at an epoch end, the one point Lightning resumes from exactly. A stop
requested mid-segment ends that segment early; the resume starts a new one at the cursor.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.progress import ProgressBar
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from trainwire.contract.config import METRICS, InputExample
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.run.progress import Progress
from trainwire.contract.run.replay import RunState, StepOutcome, run_microbatch, training_result
from trainwire.contract.run.results import TrainingResult
from trainwire.server.engine.session import StepResult, TrainingSession
from trainwire.server.training.checkpoints import (
    RECORD_FORMAT,
    RECORD_KEY,
    SessionCheckpointIO,
    TrainCheckpointRecord,
)


@contextlib.contextmanager
def engine_defaults() -> Iterator[None]:
    """Run engine operations under torch's default float32.

    Lightning's ``bf16-true`` precision makes bf16 the default dtype around ``training_step``;
    the engine must compute the same bits as every other runner, which call it without that.
    """
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def segment_end(plan: ManagedTrainingPlan, start: int) -> int:
    """One past the last microbatch of the segment starting at ``start``: the first microbatch
    at or after it that is followed by an evaluation or ends a plan epoch."""
    if not 0 <= start < plan.batch_count:
        raise RuntimeError(f"no microbatch {start} to train: the plan has {plan.batch_count}")
    end = start
    while not (plan.evaluates_after(end) or plan.is_epoch_end(end)):
        end += 1
    return end + 1


class EngineOptimizer:
    """Lightning's handle on the session's update: ``step()`` runs ``TrainingSession.optim_step``.

    Lightning counts these steps as its ``global_step``. The handle holds no state of its own:
    the optimizer moments travel in the session checkpoint, so Lightning records an empty state.
    """

    def __init__(self, session: TrainingSession) -> None:
        self.session = session
        self.defaults = dict(session.optimizer.defaults)
        self.state: defaultdict[torch.Tensor, Any] = defaultdict(dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.session.optimizer.param_groups

    def step(self, closure: Any = None) -> StepResult:
        if closure is not None:
            closure()  # Lightning's hooks around the step (on_before_optimizer_step)
        return self.session.optim_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: pending gradients are session state, zeroed by the session after an update."""

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A no-op: the session checkpoint restores the optimizer."""


class ManifestModule(pl.LightningModule):
    """Runs ``plan`` on ``session``; ``run_record`` (JSON) rides in every checkpoint it writes.

    ``training_step`` runs one microbatch through the replay's own step
    (``trainwire.contract.run.replay.run_microbatch``), with this module as its ``ReplayBackend``:
    the same operations, decisions, ``RunState``, history records and result as an in-process
    or remote run. The backend methods add what Lightning needs: the update goes through
    ``self.optimizers().step()`` so Lightning counts ``global_step``, the engine runs under
    float32 defaults (``engine_defaults``), and the figures go to Lightning's loggers.

    The session's model is deliberately not a submodule: the engine owns its parameters, device
    and dtype, and the session checkpoint, not Lightning's ``state_dict``, persists them.
    """

    def __init__(
        self,
        plan: ManagedTrainingPlan,
        session: TrainingSession,
        *,
        run_record: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.plan = plan
        self.session = session
        self.run_record = dict(run_record or {})
        self.run_state = RunState.start(plan)

    @property
    def finished(self) -> bool:
        """The plan is spent or early stopping ended it."""
        return self.run_state.finished

    # -- the loop ---------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        # Every checkpoint needs its session checkpoint beside it; install the writer unless
        # the trainer was given one, so any Trainer (create_trainer's or not) resumes exactly.
        strategy = self.trainer.strategy
        if not isinstance(strategy.checkpoint_io, SessionCheckpointIO):
            strategy.checkpoint_io = SessionCheckpointIO(self.session)

    def train_dataloader(self) -> DataLoader:
        # Reloaded at every Lightning epoch (create_trainer), from wherever the cursor stands.
        start = self.run_state.next_microbatch
        indices = range(start, segment_end(self.plan, start))
        return DataLoader(indices, batch_size=None, shuffle=False, num_workers=0)

    def configure_optimizers(self) -> EngineOptimizer:
        return EngineOptimizer(self.session)

    def on_train_epoch_start(self) -> None:
        # Lightning keeps logged values across epochs; an evaluation's metrics must be judged
        # only at the end of the segment that ran it.
        for name in METRICS:
            self.trainer.callback_metrics.pop(name, None)

    def training_step(self, index: int, batch_idx: int) -> None:
        if index != self.run_state.next_microbatch:
            raise RuntimeError(
                f"the loop offered microbatch {index}; the plan is at "
                f"{self.run_state.next_microbatch}"
            )
        progress = run_microbatch(self.plan, self, self.run_state)
        self._log_progress(progress)
        if self.run_state.finished:
            self.trainer.should_stop = True

    def _log_progress(self, progress: Progress) -> None:
        self.log_dict(
            {"microbatch_loss": progress.loss, "epoch": float(progress.epoch)},
            on_step=True,
            on_epoch=False,
        )
        if progress.update is not None:
            # Straight to the loggers, at the microbatch's index: Lightning would repeat a
            # value logged at an update in every later row of its epoch.
            update = progress.update
            figures = {
                "train_loss": update["loss"],
                "learning_rate": update["learning_rate"],
                "grad_norm": update["grad_norm"],
                "update": update["step"],
                "epoch": progress.epoch,
            }
            for run_logger in self.loggers:
                run_logger.log_metrics(figures, step=progress.microbatch)
        if progress.evaluation is not None:
            for name in METRICS:
                if name in progress.evaluation:
                    # float64: the callbacks compare exactly the values SelectionState compared.
                    value = torch.tensor(progress.evaluation[name], dtype=torch.float64)
                    self.log(name, value, on_step=True, on_epoch=False, prog_bar=True)

    # -- the replay's backend (trainwire.contract.run.replay.ReplayBackend) -----------------------

    def forward_backward(self, index: int, examples: list[InputExample]) -> tuple[float, int]:
        with engine_defaults():
            loss = self.session.forward_backward(examples)
        return loss, self.session.last_token_count

    def optim_step(self, index: int) -> StepOutcome:
        with engine_defaults():
            result: StepResult = self.optimizers().step()
        return StepOutcome(result.step, result.learning_rate, result.grad_norm)

    def forward(self, examples: list[InputExample]) -> tuple[float, list[str]]:
        """The evaluation forward: the batch loss and, for classification, the labels."""
        with engine_defaults():
            result = self.session.forward(examples)
        return result.loss, [prediction.label for prediction in result.predictions]

    def save_best(self, index: int, state: RunState) -> None:
        """Nothing here: the outcome checkpoint writes the best at this segment's end, and
        ``on_save_checkpoint`` names it in the state before anything is persisted."""

    def after_microbatch(self, index: int, state: RunState) -> None:
        """Nothing here: Lightning checkpoints at the segment's end (see the module docstring)."""

    # -- checkpoints ------------------------------------------------------------------------

    def _sync_best_checkpoint(self) -> None:
        # The outcome checkpoint names the best before it writes it (and before last.ckpt).
        best = getattr(self.trainer.checkpoint_callback, "best_model_path", "")
        self.run_state.best_checkpoint = best or None

    def record(self) -> dict[str, Any]:
        """The run's position, in JSON-safe primitives: what a checkpoint adds to the session's."""
        return {
            "format": RECORD_FORMAT,
            **self.run_record,
            "plan_fingerprint": self.plan.fingerprint,
            "config_fingerprint": self.plan.config.fingerprint(),
            "batch_count": self.plan.batch_count,
            "run_state": self.run_state.to_dict(),
            "state_digest": self.session.state_digest(),
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # SessionCheckpointIO writes the session checkpoint beside the .ckpt and names it here.
        self._sync_best_checkpoint()
        checkpoint[RECORD_KEY] = self.record()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        info = TrainCheckpointRecord.from_checkpoint(Path(self.trainer.ckpt_path), checkpoint)
        record = info.record
        if record["plan_fingerprint"] != self.plan.fingerprint:
            raise ValueError(
                f"{info.path} belongs to plan {record['plan_fingerprint']}, not to this run's "
                f"{self.plan.fingerprint}"
            )
        if info.session_checkpoint is None:
            raise ValueError(f"{info.path} names no session checkpoint")
        self.session.load_state(info.session_checkpoint)
        if self.session.state_digest() != info.state_digest:
            raise ValueError(
                f"{info.session_checkpoint} does not hold the state {info.path} recorded "
                f"({info.state_digest}); the checkpoint is torn, resume from another one"
            )
        self.run_state = RunState.from_dict(record["run_state"])

    def result(
        self, *, last_checkpoint_path: str | None, config_path: str | None = None
    ) -> TrainingResult:
        """The run's result, as every runner reports it (``training_result``)."""
        self._sync_best_checkpoint()
        return training_result(
            self.plan,
            self.run_state,
            state_digest=self.session.state_digest(),
            last_checkpoint_path=last_checkpoint_path,
            config_path=config_path,
        )


class PlanProgressBar(ProgressBar):
    """One bar over the whole plan's microbatches (Lightning's own would count segments),
    showing the plan epoch, the updates applied and the latest loss and evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._bar: Any = None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._enabled and isinstance(pl_module, ManifestModule):
            start = pl_module.run_state.next_microbatch
            total = pl_module.plan.batch_count
            self._bar = tqdm(total=total, initial=start, unit="microbatch", dynamic_ncols=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self._bar is None:
            return
        state = pl_module.run_state
        figures: dict[str, Any] = {
            "epoch": pl_module.plan.epoch(state.next_microbatch - 1),
            "update": pl_module.session.step,
        }
        for record in reversed(state.history):
            if record["kind"] == "update" and "loss" not in figures:
                figures["loss"] = f"{record['loss']:.4f}"
            if record["kind"] == "evaluation" and "eval" not in figures:
                metric = state.selection.metric
                figures["eval"] = f"{metric} {record[metric]:.4f}"
        self._bar.set_postfix(figures, refresh=False)
        self._bar.update(1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

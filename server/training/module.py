"""The LightningModule that drives the one engine through a manifest's microbatches.

The engine does the math (``TrainingSession``: forward_backward, optim_step, forward), exactly as
every other runner calls it; Lightning provides the loop, the callbacks, checkpoints and
logging. One ``training_step`` is one microbatch of the plan, offered by a DataLoader over
microbatch indices, so the loop, the plan and the logs share one index.

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

from trainwire.client.config import METRICS
from trainwire.client.evaluation import EvaluationTally, evaluation_batches
from trainwire.client.plan import ManagedTrainingPlan
from trainwire.client.progress import evaluation_record, update_record
from trainwire.client.replay import RunState, training_result
from trainwire.client.results import TrainingResult
from trainwire.server.session import StepResult, TrainingSession
from trainwire.server.training.checkpoints import RECORD_FORMAT, RECORD_KEY, CheckpointInfo


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

    Each microbatch takes the steps of the shared replay loop (``trainwire.client.replay``) in
    the same order, with the same ``RunState``, history records and result, so a local run
    decides and ends exactly as an in-process or remote one.

    The session's model is deliberately not a submodule: the engine owns its parameters, device
    and dtype, and the session checkpoint, not Lightning's ``state_dict``, persists them.
    """

    def __init__(
        self, plan: ManagedTrainingPlan, session: TrainingSession, *, run_record: dict[str, Any]
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.plan = plan
        self.session = session
        self.run_record = dict(run_record)
        self.run_state = RunState.start(plan)

    @property
    def finished(self) -> bool:
        """The plan is spent or early stopping ended it."""
        return self.run_state.finished

    # -- the loop ---------------------------------------------------------------------------

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
        state, plan = self.run_state, self.plan
        if index != state.next_microbatch:
            raise RuntimeError(
                f"the loop offered microbatch {index}; the plan is at {state.next_microbatch}"
            )
        epoch, step = plan.epoch(index), plan.steps_after(index)
        with engine_defaults():
            loss = self.session.forward_backward(plan.batch(index))
        state.pending_losses.append(loss)
        self.log_dict(
            {"microbatch_loss": loss, "epoch": float(epoch)}, on_step=True, on_epoch=False
        )
        if plan.is_update(index):
            self._update(index, epoch)
        state.next_microbatch = index + 1
        if plan.evaluates_after(index):
            self._evaluate(index, epoch, step)
        state.finished = state.selection.stopped_early or index + 1 == plan.batch_count
        if state.finished:
            self.trainer.should_stop = True

    def _update(self, index: int, epoch: int) -> None:
        with engine_defaults():
            outcome: StepResult = self.optimizers().step()
        record = update_record(
            microbatch=index,
            epoch=epoch,
            step=outcome.step,
            losses=self.run_state.pending_losses,
            learning_rate=outcome.learning_rate,
            grad_norm=outcome.grad_norm,
        )
        self.run_state.history.append(record)
        self.run_state.pending_losses = []
        # Straight to the loggers, at the microbatch's index: Lightning would repeat a value
        # logged at an update in every later row of its epoch.
        figures = {
            "train_loss": record["loss"],
            "learning_rate": outcome.learning_rate,
            "grad_norm": outcome.grad_norm,
            "update": outcome.step,
            "epoch": epoch,
        }
        for run_logger in self.loggers:
            run_logger.log_metrics(figures, step=index)

    def _evaluate(self, index: int, epoch: int, step: int) -> None:
        tally = EvaluationTally()
        with engine_defaults():
            for batch in evaluation_batches(
                self.plan.eval_examples or (), self.plan.config.batch_size
            ):
                result = self.session.forward(batch)
                tally.add(batch, result.loss, [p.label for p in result.predictions])
        metrics = tally.metrics()
        is_best = self.run_state.selection.observe(metrics, step=step, epoch=epoch)
        self.run_state.history.append(
            evaluation_record(
                microbatch=index, epoch=epoch, step=step, metrics=metrics, is_best=is_best
            )
        )
        for name, value in metrics.items():
            # float64, so the callbacks compare exactly the values SelectionState compares.
            value64 = torch.tensor(value, dtype=torch.float64)
            self.log(name, value64, on_step=True, on_epoch=False, prog_bar=True)

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
        info = CheckpointInfo.from_checkpoint(Path(self.trainer.ckpt_path), checkpoint)
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

    def result(self, *, last_checkpoint: str | None) -> TrainingResult:
        self._sync_best_checkpoint()
        return training_result(
            self.plan,
            self.run_state,
            state_digest=self.session.state_digest(),
            last_checkpoint=last_checkpoint,
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

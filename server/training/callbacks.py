"""The Lightning callbacks that decide a run's outcome: its best checkpoint and early stopping.

Both judge the monitored metric at the end of a Lightning epoch. A ``trainwire train`` module
ends a Lightning epoch at every evaluation (and every plan epoch end), and publishes an
evaluation's metrics only in the epoch that ran it, so each evaluation is judged exactly once:
the same decisions ``SelectionState`` makes for every other runner.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

BEST_FILENAME = "best-{epoch}-{step}"


class OutcomeCheckpoint(ModelCheckpoint):
    """Keeps the earliest checkpoint with the best monitored metric, and ``last.ckpt`` always.

    Lightning 2.6 refreshes ``last.ckpt`` only when it also wrote a top-k checkpoint, and
    judges progress by optimizer steps alone. A resume needs the latest state, pending
    gradients of a stop mid-accumulation included, so this refreshes ``last.ckpt`` at every
    epoch end after which a batch ran since the last save. An epoch that did not publish the
    monitored metric writes ``last.ckpt`` only.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._saved_after_batch: int | None = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is None or self.monitor in trainer.callback_metrics:
            super().on_train_epoch_end(trainer, pl_module)
        if self.save_last and self._saved_after_batch != trainer.fit_loop.total_batch_idx:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self._saved_after_batch = trainer.fit_loop.total_batch_idx


def outcome_checkpoint(
    checkpoint_dir: str | Path, *, monitor: str | None = "eval_loss", mode: str = "min"
) -> OutcomeCheckpoint:
    """The ModelCheckpoint the selection metric drives, writing into ``checkpoint_dir``.

    It keeps one best checkpoint, ``best-epoch=E-step=S.ckpt``: the earliest evaluation with
    the best ``monitor`` (``min`` or ``max``; a later equal value does not replace it), and
    ``last.ckpt`` for exact resume. With ``monitor=None`` (a run without evaluation) only
    ``last.ckpt`` is kept. ``refuse_a_resume_from_another_directory`` reads this callback's
    saved state.
    """
    return OutcomeCheckpoint(
        dirpath=str(checkpoint_dir),
        filename=BEST_FILENAME,
        monitor=monitor,
        mode=mode,
        save_top_k=1 if monitor is not None else 0,
        save_last=True,
        save_on_train_epoch_end=True,
        enable_version_counter=False,
    )


def outcome_early_stopping(
    patience: int, *, monitor: str = "eval_loss", mode: str = "min"
) -> EarlyStopping:
    """The EarlyStopping the selection metric drives.

    It stops after ``patience`` evaluations without gain, judged at a Lightning epoch's end
    before the checkpoint callback saves (Lightning runs checkpoint callbacks last), so a
    stopped run's ``last.ckpt`` records the stop. ``min_delta`` is 0: a tie is no gain and
    counts against the patience. An epoch without the metric is not judged.
    ``refuse_a_resume_of_a_stopped_run`` reads this callback's saved state.
    """
    return EarlyStopping(
        monitor=monitor,
        mode=mode,
        patience=patience,
        min_delta=0.0,
        strict=False,
        check_finite=False,
        check_on_train_epoch_end=True,
    )


class StopOnInterrupt(pl.Callback):
    """Ctrl-C stops the run after the microbatch in flight, so ``last.ckpt`` holds exactly
    where it stopped; a second Ctrl-C interrupts at once (Lightning then exits with status 1).

    Without it, Lightning exits on the first Ctrl-C and the resume starts from the last
    checkpoint it had written before.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _request(self, signum: int, frame: Any) -> None:
        self.requested = True
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Signal handlers live in the main thread only; elsewhere Ctrl-C keeps its default.
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, self._request)
            self._previous = signal.default_int_handler if previous is None else previous

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.requested:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, *args: Any) -> None:
        self._restore()

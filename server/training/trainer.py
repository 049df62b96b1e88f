"""The Lightning Trainer of a local run: one device, the detected precision, the outcome
callbacks and a CSV (or TensorBoard) logger."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from trainwire.server.training.callbacks import outcome_checkpoint, outcome_early_stopping
from trainwire.server.training.checkpoints import CHECKPOINT_DIR
from trainwire.server.training.hardware import HardwareInfo

LOG_DIR = "logs"
LOGGERS = ("csv", "tensorboard")


def create_trainer(
    output_dir: str | Path,
    *,
    hardware: HardwareInfo,
    monitor: str | None = "eval_loss",
    mode: str = "min",
    patience: int | None = None,
    callbacks: Sequence[Callback] = (),
    plugins: Sequence[Any] = (),
    logger: str = "csv",
    enable_progress_bar: bool = False,
) -> pl.Trainer:
    """A Trainer on one ``hardware.accelerator`` device at ``hardware.precision``.

    Checkpoints go to ``output_dir/checkpoints`` (``outcome_checkpoint`` by ``monitor``; None
    keeps ``last.ckpt`` only), early stopping joins when ``patience`` is given, logs go to
    ``output_dir/logs``. The loop is driven by the module: it runs until the module stops it
    (``max_epochs=-1``) and asks for a new DataLoader at every epoch.
    """
    if logger not in LOGGERS:
        raise ValueError(f"logger must be one of {', '.join(LOGGERS)}, got {logger!r}")
    output = Path(output_dir)
    outcome: list[Callback] = [
        outcome_checkpoint(output / CHECKPOINT_DIR, monitor=monitor, mode=mode)
    ]
    if patience is not None and monitor is not None:
        outcome.append(outcome_early_stopping(patience, monitor=monitor, mode=mode))
    return pl.Trainer(
        accelerator=hardware.accelerator,
        devices=1,
        precision=hardware.precision,
        max_epochs=-1,
        reload_dataloaders_every_n_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=[*outcome, *callbacks],
        plugins=list(plugins),
        logger=_logger(output, logger),
        default_root_dir=str(output),
        enable_model_summary=False,
        enable_progress_bar=enable_progress_bar,
    )


def _logger(output: Path, kind: str) -> Logger:
    if kind == "tensorboard":
        return TensorBoardLogger(save_dir=str(output), name=LOG_DIR)
    return CSVLogger(save_dir=str(output), name=LOG_DIR)

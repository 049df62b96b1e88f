"""The Lightning Trainer of a local run: one device, the run's precision, the outcome callbacks
and a CSV (or TensorBoard) logger."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from trainwire.contract.config import TrainingConfig
from trainwire.server.training.callbacks import (
    OutcomeCheckpoint,
    outcome_checkpoint,
    outcome_early_stopping,
)
from trainwire.server.training.hardware import HardwareInfo, effective_precision

logger = logging.getLogger(__name__)

LOG_DIR = "logs"
LOGGERS = ("csv", "tensorboard")


def create_trainer(
    cfg: TrainingConfig,
    hardware: HardwareInfo,
    checkpoint_dir: str | Path,
    callbacks: Sequence[Callback] | None = None,
    tb_logger: Logger | None = None,
    *,
    logger_kind: str = "csv",
    log_dir: str | Path | None = None,
    plugins: Sequence[Any] = (),
    enable_progress_bar: bool = False,
) -> tuple[pl.Trainer, OutcomeCheckpoint, EarlyStopping | None]:
    """A Trainer for a ``ManifestModule`` on one ``hardware.accelerator`` device.

    The outcome callbacks follow ``cfg``: ``outcome_checkpoint(checkpoint_dir)`` by
    ``metric_for_best`` (only ``last.ckpt`` without evaluation) and, when ``cfg`` stops
    early, ``outcome_early_stopping(early_stopping_patience)``; both judge at a Lightning
    epoch's end, which the module places after every evaluation. The loop is the module's: it
    runs until the module stops it (``max_epochs=-1``) and asks for a new DataLoader at every
    epoch.

    Differences from the seed, on purpose: the precision is ``effective_precision(cfg,
    hardware.accelerator)``, never autocast over the engine (a ``hardware.precision`` that
    differs is logged and not used); the EarlyStopping is None for a run that does not stop
    early; ``tb_logger`` may be any Lightning logger, and without one a CSV logger is created
    (``logger_kind="tensorboard"`` for TensorBoard, which needs the ``tensorboard`` package) in
    ``log_dir``, by default ``logs`` beside ``checkpoint_dir``.

    Returns:
        ``(trainer, checkpoint_callback, early_stopping_callback_or_None)``.

    Example:
        >>> hw = detect_hardware()
        >>> trainer, ckpt_cb, es_cb = create_trainer(cfg, hw, Path("checkpoints"))
        >>> trainer.fit(ManifestModule(plan, session))
    """
    if logger_kind not in LOGGERS:
        raise ValueError(f"logger must be one of {', '.join(LOGGERS)}, got {logger_kind!r}")
    precision = effective_precision(cfg, hardware.accelerator)
    if precision != hardware.precision:
        logger.info(
            "the config's precision %s (%s) wins over the detected %s",
            cfg.precision,
            precision,
            hardware.precision,
        )
    monitor = None if cfg.eval_strategy == "no" else cfg.metric_for_best
    checkpoint = outcome_checkpoint(checkpoint_dir, monitor=monitor, mode=cfg.selection_mode)
    stopping = None
    if cfg.early_stopping and monitor is not None:
        stopping = outcome_early_stopping(
            cfg.early_stopping_patience, monitor=monitor, mode=cfg.selection_mode
        )
    root = Path(checkpoint_dir).parent
    trainer = pl.Trainer(
        accelerator=hardware.accelerator,
        devices=1,
        precision=precision,
        max_epochs=-1,
        reload_dataloaders_every_n_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=[checkpoint, *([stopping] if stopping else []), *(callbacks or ())],
        plugins=list(plugins),
        logger=tb_logger or _logger(Path(log_dir) if log_dir else root / LOG_DIR, logger_kind),
        default_root_dir=str(root),
        enable_model_summary=False,
        enable_progress_bar=enable_progress_bar,
    )
    return trainer, checkpoint, stopping


def _logger(directory: Path, kind: str) -> Logger:
    if kind == "tensorboard":
        return TensorBoardLogger(save_dir=str(directory.parent), name=directory.name)
    return CSVLogger(save_dir=str(directory.parent), name=directory.name)

"""``trainwire train --tensorboard``: the run's history as TensorBoard event files, as it trains.

The figures are the history's (``trainwire.contract.report.tensorboard_log``): the same files
and tags ``trainwire run --tensorboard`` writes, at the update count, as ``metrics.jsonl`` holds
them. What the module hands Lightning's loggers is indexed by the microbatch instead, and a
resume would write its steps again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from trainwire.contract.report.tensorboard_log import TensorBoardLog


class TensorBoardHistory(pl.Callback):
    """Writes a ``ManifestModule``'s history to event files under ``directory`` after every
    microbatch. At the start it writes what a restored run's history holds and the files do not
    (a run killed after its checkpoint wrote steps the resume then runs again, which it skips)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._board: TensorBoardLog | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # After Lightning restored a checkpoint: the module holds the resumed run's history.
        self._board = TensorBoardLog(self.directory)
        self._board.follow(pl_module.run_state.history)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self._board is not None:
            self._board.follow(pl_module.run_state.history)

    def teardown(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        # Also after an exception: what was written stays flushed and the file is closed.
        if self._board is not None:
            self._board.close()
            self._board = None

"""A live progress view of a run: a tqdm bar on a terminal, a plain log line otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from trainwire.client.progress import Progress

logger = logging.getLogger(__name__)


class ProgressReporter:
    """An ``on_step`` callback: microbatch i/N, epoch, step, loss, eval metric, rate, ETA.

    ``quiet`` prints nothing; without a terminal it logs one line every ``log_every`` updates.
    """

    def __init__(self, *, quiet: bool = False, log_every: int = 10, stream: Any = None) -> None:
        self.quiet = quiet
        self.log_every = log_every
        self.stream = stream or sys.stderr
        self.bar: Any = None
        self.started = time.monotonic()
        self.last_metric = ""

    def __call__(self, progress: Progress) -> None:
        if self.quiet:
            return
        if progress.evaluation is not None:
            metrics = {k: v for k, v in progress.evaluation.items() if k.startswith("eval_")}
            self.last_metric = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        if self.stream.isatty():
            self._bar(progress)
        elif progress.update is not None and (
            progress.step % self.log_every == 0 or progress.evaluation is not None
        ):
            self._line(progress)

    def _bar(self, progress: Progress) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(
                total=progress.batch_count,
                initial=progress.microbatch,
                unit="mb",
                file=self.stream,
                dynamic_ncols=True,
            )
        self.bar.update(progress.microbatch + 1 - self.bar.n)
        postfix = {"epoch": progress.epoch, "step": f"{progress.step}/{progress.max_steps}"}
        postfix["loss"] = f"{progress.loss:.4f}"
        if self.last_metric:
            postfix["eval"] = self.last_metric
        self.bar.set_postfix(postfix, refresh=False)

    def _line(self, progress: Progress) -> None:
        done = progress.microbatch + 1
        elapsed = time.monotonic() - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (progress.batch_count - done) / rate if rate else 0.0
        print(
            f"microbatch {done}/{progress.batch_count} epoch {progress.epoch} "
            f"step {progress.step}/{progress.max_steps} loss {progress.update['loss']:.4f} "
            f"{self.last_metric} {rate:.1f} mb/s eta {eta:.0f}s".replace("  ", " "),
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

"""A live progress view of a run: a tqdm bar on a terminal, a plain log line otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from trainwire.client.progress import Progress

logger = logging.getLogger(__name__)


class ProgressReporter:
    """An ``on_step`` callback: microbatch i/N, epoch, step, loss, eval metric, tokens/s, ETA.

    ``quiet`` prints nothing; without a terminal it logs one line every ``log_every`` updates.
    """

    def __init__(self, *, quiet: bool = False, log_every: int = 10, stream: Any = None) -> None:
        self.quiet = quiet
        self.log_every = log_every
        self.stream = stream or sys.stderr
        self.bar: Any = None
        self.started = time.monotonic()
        self.last_metric = ""
        self.tokens = 0
        self.seen = 0

    def __call__(self, progress: Progress) -> None:
        if self.quiet:
            return
        self.tokens += progress.tokens
        self.seen += 1
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
        postfix["tok/s"] = f"{self.tokens_per_second():.0f}"
        if self.last_metric:
            postfix["eval"] = self.last_metric
        self.bar.set_postfix(postfix, refresh=False)

    def tokens_per_second(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def _line(self, progress: Progress) -> None:
        done = progress.microbatch + 1
        elapsed = time.monotonic() - self.started
        # The rate of this process's own microbatches: a resumed run starts part way through.
        rate = self.seen / elapsed if elapsed > 0 else 0.0
        eta = (progress.batch_count - done) / rate if rate else 0.0
        parts = [
            f"microbatch {done}/{progress.batch_count}",
            f"epoch {progress.epoch}",
            f"step {progress.step}/{progress.max_steps}",
            f"loss {progress.update['loss']:.4f}",
            self.last_metric,
            f"{self.tokens_per_second():.0f} tok/s",
            f"eta {eta:.0f}s",
        ]
        print(" ".join(part for part in parts if part), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
